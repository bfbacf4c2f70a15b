"""What this machine has (memory, disk) and what a piece of work used (peak memory, time), standard library only.

Memory is counted the way the kernel's OOM killer sees it, not the way ``top``'s RSS shows it:

* **available**: /proc/meminfo's ``MemAvailable`` (free memory plus the page cache and reclaimable slabs the
  kernel can drop), lowered to what a cgroup v2 limit leaves (``memory.max`` minus the group's usage net of its
  reclaimable file pages), and to ``Settings.memory_budget`` where that is set (a smaller budget than the
  machine: another job shares it, or a test). A memory-mapped model file lives in the page cache, so it is
  *available*: a GGUF that llama.cpp maps does not count against it, the weights a process loads into its own
  memory (torch, a repacked llama.cpp buffer) do.
* **in use** (the machine's): total minus available, sampled while a stage runs.
* **a process tree's**: the sum of ``RssAnon + RssShmem`` (/proc/PID/status) over the process and its
  descendants: its own memory, without the file pages it maps (RSS counts a mapped 15 GB GGUF as 15 GB).

:class:`Sampler` samples both every :data:`SAMPLE_S` seconds in a thread; stages run inside one, so each
stage's peak is part of its outcome (flows/quantize.py), and runs measure themselves with it.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

GIB = 1024**3
SAMPLE_S = 0.25
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str) -> int:
    """``8G``, ``512M``, ``1.5GiB`` or a number of bytes, in bytes (binary units: 1G = 2^30).

    Raises:
        ValueError: not a size.
    """
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"expected a size such as 8G, 512M or a number of bytes, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def gib(n: float | None) -> str:
    """``n`` bytes as ``12.3 GiB``, or ``312 MiB`` below 1 GiB (``—`` for None)."""
    if n is None:
        return "—"
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / 1024**2:.0f} MiB"


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def _cgroup_dir() -> Path | None:
    """This process's cgroup v2 folder, where it has one with a memory controller."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                d = Path("/sys/fs/cgroup") / line[3:].strip().lstrip("/")
                return d if (d / "memory.max").is_file() else None
    except OSError:
        return None
    return None


def _cgroup_available() -> tuple[int, int] | None:
    """(limit, what the limit leaves) of this process's cgroup, or None where there is no limit."""
    d = _cgroup_dir()
    if d is None:
        return None
    try:
        raw = (d / "memory.max").read_text().strip()
        if raw == "max":
            return None
        limit = int(raw)
        current = int((d / "memory.current").read_text())
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines() if " " in line)
        reclaimable = int(stat.get("inactive_file", 0)) + int(stat.get("active_file", 0))
    except (OSError, ValueError):
        return None
    return limit, max(0, limit - max(0, current - reclaimable))


@dataclass(frozen=True)
class Memory:
    """What the machine has now. ``available``: what work may use (the smallest of the limits below);
    ``limited_by``: which limit that is (MemAvailable, a cgroup's memory.max, or the memory budget)."""

    total: int
    available: int
    limited_by: str

    def describe(self) -> str:
        return f"{gib(self.available)} available ({self.limited_by}; {gib(self.total)} in all)"


def memory(budget: int | None = None) -> Memory:
    """This machine's memory now (module docstring); ``budget``: Settings.memory_budget in bytes."""
    info = _meminfo()
    total = info.get("MemTotal", 0)
    available = info.get("MemAvailable", info.get("MemFree", 0))
    limited_by = "MemAvailable"
    group = _cgroup_available()
    if group is not None and group[1] < available:
        total, available, limited_by = min(total, group[0]), group[1], "cgroup memory.max"
    if budget is not None and budget < available:
        total, available, limited_by = min(total, budget), budget, "QUANTYARD_MEMORY_BUDGET"
    return Memory(total=total, available=available, limited_by=limited_by)


def in_use() -> int:
    """The machine's memory in use now: total minus available (page cache, hence mapped files, excluded)."""
    info = _meminfo()
    return max(0, info.get("MemTotal", 0) - info.get("MemAvailable", 0))


def existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a folder not made yet will be)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def disk_free(path: Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) ``path``."""
    return shutil.disk_usage(existing(path)).free


def device_of(path: Path) -> int:
    """The filesystem (st_dev) that holds (or will hold) ``path``."""
    return existing(path).stat().st_dev


def gpu_free() -> int | None:
    """Free memory of the first GPU ``nvidia-smi`` lists, None where there is none (or no nvidia-smi)."""
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.free", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20, check=False).stdout.split()
        return int(float(out[0])) * 1024**2 if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _own(pid: int) -> int:
    """``RssAnon + RssShmem`` of one process, in bytes (0 when it is gone)."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``."""
    out: set[int] = set()
    todo = _children(pid)
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(_children(p))
    return out


def tree_memory(pid: int | None = None, skip: frozenset[int] = frozenset()) -> int:
    """``RssAnon + RssShmem`` of process ``pid`` (default: this one) and its descendants but ``skip`` (and what is
    below those), in bytes."""
    root = os.getpid() if pid is None else pid
    total, todo, seen = _own(root), _children(root), {root}
    while todo:
        p = todo.pop()
        if p in seen or p in skip:
            continue
        seen.add(p)
        total += _own(p)
        todo.extend(_children(p))
    return total


@dataclass(frozen=True)
class Usage:
    """What a piece of work used: seconds, the peak of its own memory (:class:`Sampler`) and the peak of the
    machine's memory in use while it ran (module docstring), and that at its start."""

    wall_s: float
    peak_process_bytes: int
    peak_in_use_bytes: int
    start_in_use_bytes: int

    def as_dict(self) -> dict[str, float | int]:
        return {"wall_s": round(self.wall_s, 3), "peak_process_bytes": self.peak_process_bytes,
                "peak_in_use_bytes": self.peak_in_use_bytes, "start_in_use_bytes": self.start_in_use_bytes}

    def describe(self) -> str:
        return f"{self.wall_s:.1f} s, peak {gib(self.peak_process_bytes)} own, {gib(self.peak_in_use_bytes)} in use"


class Sampler:
    """Samples the memory a piece of work takes and the machine's memory in use, in a daemon thread (``with
    Sampler() as s: ...`` then ``s.usage``). The work's memory: what the process ``pid`` (default: this one)
    holds beyond what it held at the start, plus every process started below it meanwhile (the tools it runs);
    processes already running below it at the start (Prefect's embedded server) are not the work's."""

    def __init__(self, pid: int | None = None, period: float = SAMPLE_S) -> None:
        self.pid, self.period = pid, period
        self._root = os.getpid() if pid is None else pid
        self._skip: frozenset[int] = frozenset()
        self._base = 0
        self.peak_process = 0
        self.peak_in_use = 0
        self.start_in_use = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self.usage: Usage | None = None

    def sample(self) -> None:
        self.peak_process = max(self.peak_process, tree_memory(self._root, self._skip) - self._base)
        self.peak_in_use = max(self.peak_in_use, in_use())

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def __enter__(self) -> Sampler:
        self._t0 = time.perf_counter()
        self.start_in_use = in_use()
        self._skip = frozenset(descendants(self._root))
        self._base = _own(self._root)
        self.sample()
        self._thread = threading.Thread(target=self._run, name="quantyard-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        self.usage = Usage(wall_s=time.perf_counter() - self._t0, peak_process_bytes=self.peak_process,
                           peak_in_use_bytes=self.peak_in_use, start_in_use_bytes=self.start_in_use)
