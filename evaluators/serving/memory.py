"""Memory of a running server, measured: weights on disk, resident memory of its whole process tree, device
memory on a GPU, sampled in the background so that a caller can read the peak of each load level.

* **Resident memory** (RSS) is summed over the server and every descendant (vLLM's API server, engine core
  and workers; llama-server is one process), read from /proc through psutil. A page shared by two processes
  (a library both map) counts once per process, as ``ps`` would show; :meth:`MemorySampler.snapshot` adds the
  proportional set size (PSS, shared pages split between their users) for a one-off reading.
* **Device memory** comes from ``nvidia-smi --query-compute-apps`` for the tree's pids; where the server's
  pids are invisible to it (a container's PID namespace), the device's whole used memory minus what was used
  before the server started, and :attr:`DeviceMemory.method` says which.
* The sampler reads RSS every ``interval_s`` (default 100 ms) and device memory every ``device_interval_s``
  (500 ms: each reading is an ``nvidia-smi`` call); it re-lists the tree every second. A peak is the largest
  sample: a spike shorter than the interval can be missed.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil  # type: ignore[import-untyped]

#: Files that hold weights (a folder's other files, tokenizer and config, are not counted).
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")
TREE_REFRESH_S = 1.0


def weights_bytes(model: Path) -> int:
    """Bytes of a variant's weights on disk: the size of a file, or the sum of a folder's weight files
    (:data:`WEIGHT_SUFFIXES`, symlinks followed).

    Raises:
        FileNotFoundError: ``model`` does not exist.
    """
    if model.is_file():
        return model.stat().st_size
    if not model.is_dir():
        raise FileNotFoundError(f"no model file or folder at {model}")
    return sum(p.stat().st_size for p in model.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants that exist now (empty when ``root`` is gone)."""
    try:
        proc = psutil.Process(root)
        return [root, *(c.pid for c in proc.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += psutil.Process(pid).memory_info().rss
    return total


def _pss(pids: list[int]) -> int | None:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except psutil.NoSuchProcess:
            continue
        except (psutil.AccessDenied, AttributeError):
            return None
    return total


@dataclass(frozen=True)
class MemorySample:
    """One reading: ``rss_bytes`` summed over ``pids``, ``pss_bytes`` (None where unreadable or not asked),
    ``device_bytes`` (None without a GPU)."""

    rss_bytes: int
    pss_bytes: int | None
    device_bytes: int | None
    pids: tuple[int, ...]


@dataclass(frozen=True)
class LevelPeak:
    """The peaks of one load level (bytes; device None without a GPU) and the samples they came from."""

    rss_peak_bytes: int
    device_peak_bytes: int | None
    samples: int
    duration_s: float


class DeviceMemory:
    """GPU memory used by a set of processes, from ``nvidia-smi``. Construct it before the server starts: it
    records the device's used memory then, for the fallback.

    Raises:
        FileNotFoundError: no ``nvidia-smi`` on PATH.
    """

    def __init__(self) -> None:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            raise FileNotFoundError("nvidia-smi is not on PATH: no device memory to measure")
        self.exe = exe
        self.baseline = self._used_total()
        self.method = "nvidia-smi --query-compute-apps (per process)"

    def _query(self, *args: str) -> list[list[str]]:
        out = subprocess.run([self.exe, *args, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=False).stdout
        return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]

    def _used_total(self) -> int:
        return sum(int(float(r[0])) for r in self._query("--query-gpu=memory.used") if r and r[0]) * 2**20

    def read(self, pids: list[int]) -> int:
        """Bytes of device memory ``pids`` hold; the device's used memory minus the baseline when none of
        them is listed (and then :attr:`method` says so)."""
        rows = self._query("--query-compute-apps=pid,used_memory")
        wanted = set(pids)
        mine = [int(float(r[1])) for r in rows if len(r) > 1 and r[0].isdigit() and int(r[0]) in wanted]
        if mine:
            return sum(mine) * 2**20
        self.method = "nvidia-smi memory.used minus the baseline before start (processes not visible)"
        return max(0, self._used_total() - self.baseline)


class MemorySampler:
    """Samples the memory of the process tree under ``root`` in a background thread (see the module doc).

    Use as a context manager, or :meth:`start` / :meth:`stop`. :meth:`start_level` / :meth:`end_level`
    bracket one load level and return its peaks; :attr:`peak_rss_bytes` / :attr:`peak_device_bytes` are
    the peaks since :meth:`start`.
    """

    def __init__(self, root: int, *, interval_s: float = 0.1, device: DeviceMemory | None = None,
                 device_interval_s: float = 0.5) -> None:
        self.root = root
        self.interval_s = interval_s
        self.device = device
        self.device_interval_s = device_interval_s
        self.peak_rss_bytes = 0
        self.peak_device_bytes: int | None = None
        self.samples = 0
        self._level: list[int | None] | None = None  # [rss peak, device peak, samples]
        self._level_t0 = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> MemorySampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Take a first sample now, then sample in a daemon thread."""
        self._record(_rss(tree_pids(self.root)), None)
        self._thread = threading.Thread(target=self._run, name=f"memory-{self.root}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        pids: list[int] = []
        listed = device_at = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - listed >= TREE_REFRESH_S or not pids:
                pids, listed = tree_pids(self.root), now
            rss = _rss(pids)
            dev = None
            if self.device is not None and now - device_at >= self.device_interval_s:
                with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
                    dev = self.device.read(pids)
                device_at = now
            self._record(rss, dev)
            self._stop.wait(self.interval_s)

    def _record(self, rss: int, dev: int | None) -> None:
        with self._lock:
            self.samples += 1
            self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
            if dev is not None:
                self.peak_device_bytes = max(self.peak_device_bytes or 0, dev)
            if self._level is not None:
                lv = self._level
                lv[0] = max(lv[0] or 0, rss)
                lv[1] = lv[1] if dev is None else max(lv[1] or 0, dev)
                lv[2] = (lv[2] or 0) + 1

    def snapshot(self) -> MemorySample:
        """Memory now (RSS, PSS and device memory of the tree), read directly, not from the samples."""
        pids = tree_pids(self.root)
        dev = self.device.read(pids) if self.device is not None else None
        return MemorySample(rss_bytes=_rss(pids), pss_bytes=_pss(pids), device_bytes=dev, pids=tuple(pids))

    def start_level(self) -> None:
        """Start a load level: its peaks count from now (one sample is taken at once)."""
        with self._lock:
            self._level = [0, None, 0]
            self._level_t0 = time.monotonic()
        self._record(_rss(tree_pids(self.root)), None)

    def end_level(self) -> LevelPeak:
        """End the load level begun by :meth:`start_level`; returns its peaks.

        Raises:
            RuntimeError: no level was started.
        """
        self._record(_rss(tree_pids(self.root)), None)
        with self._lock:
            if self._level is None:
                raise RuntimeError("end_level() without start_level()")
            rss, dev, n = self._level
            self._level = None
            return LevelPeak(rss_peak_bytes=int(rss or 0), device_peak_bytes=dev, samples=int(n or 0),
                             duration_s=time.monotonic() - self._level_t0)
