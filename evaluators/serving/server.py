"""Start a variant's engine server, wait until it is healthy, measure it, and stop it cleanly.

:func:`start_server` is the one entry point: ``with start_server(spec, settings, log_dir) as srv:`` gives a
:class:`RunningServer` (its ``base_url``, ``pid``, the :class:`~pipeline.serving.ServerInfo` it records, a
memory sampler already running) once the server answers; leaving the block stops it (SIGTERM to its process
group, SIGKILL after ``spec.stop_grace_s``) and waits for it. The engine's own launcher
(``evaluators/<engine>/server.py``, named by ``EngineInfo.server``) decides the command; this module runs it
on 127.0.0.1 at a free port, under the keeper (evaluators/serving/supervise.py), so that no server outlives
the run that started it, not even when that run is killed.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import cast

from evaluators.engines import engine_info
from evaluators.serving import supervise
from evaluators.serving.memory import DeviceMemory, LevelPeak, MemorySample, MemorySampler, tree_pids, weights_bytes
from evaluators.serving.spec import LaunchPlan, LogFacts, Planner, ServerSpec
from pipeline.config import Settings
from pipeline.errors import EngineError, ToolchainMissingError
from pipeline.serving import MemoryInfo, ServerInfo

HOST = "127.0.0.1"
#: Launch attempts when the chosen port is taken between choosing and binding.
PORT_ATTEMPTS = 3
_PORT_TAKEN = ("address already in use", "couldn't bind", "could not bind", "errno 98")
TAIL_BYTES = 6000


@dataclass
class RunningServer:
    """A healthy server (see :func:`start_server`). Seconds and bytes throughout."""

    spec: ServerSpec
    info: ServerInfo
    base_url: str  # http://127.0.0.1:PORT (no trailing slash; the OpenAI routes are under /v1)
    model_name: str  # the "model" a request names
    pid: int  # the server process (its keeper's child)
    keeper_pid: int  # the keeper, leader of the process group
    log_path: Path
    start_s: float  # launch → healthy
    weights_bytes: int
    after_load: MemorySample  # right after it became healthy
    facts: LogFacts  # what the log said (KV cache, confirmed settings)
    sampler: MemorySampler
    device_method: str | None = None  # how device memory is measured (None without a GPU)
    _keeper: subprocess.Popen[bytes] | None = None
    _record: Path | None = None  # WORK/servers/<owner>-<keeper>.json

    def memory(self) -> MemorySample:
        """Memory of the server's process tree now (RSS, PSS, device)."""
        return self.sampler.snapshot()

    def start_level(self) -> None:
        """A load level starts: peaks count from now."""
        self.sampler.start_level()

    def end_level(self) -> LevelPeak:
        """The load level ends: its RSS peak (and device peak on a GPU)."""
        return self.sampler.end_level()

    def alive(self) -> bool:
        """Whether the server process still runs."""
        return self._keeper is not None and self._keeper.poll() is None

    def log_tail(self, n_bytes: int = TAIL_BYTES) -> str:
        """The last ``n_bytes`` of the server's log."""
        return _tail(self.log_path, n_bytes)

    def memory_info(self, concurrency: int | None = None) -> MemoryInfo:
        """The serving result's memory: weights, after load, the peaks since start, the KV cache the engine
        reported; ``concurrency`` defaults to the server's slots."""
        return MemoryInfo(weights_bytes=self.weights_bytes, rss_after_load_bytes=self.after_load.rss_bytes,
                          rss_peak_bytes=self.sampler.peak_rss_bytes or None,
                          device_after_load_bytes=self.after_load.device_bytes,
                          device_peak_bytes=self.sampler.peak_device_bytes,
                          kv_cache_bytes=self.facts.kv_cache_bytes, kv_cache_tokens=self.facts.kv_cache_tokens,
                          kv_cache_source=self.facts.kv_cache_source, context=self.spec.context,
                          concurrency=concurrency if concurrency is not None else self.spec.slots)


def planner(engine: str) -> Planner:
    """The launcher of ``engine`` (``EngineInfo.server``).

    Raises:
        UnknownFormatError: no such engine.
        ToolchainMissingError: the engine has no server.
    """
    info = engine_info(engine)
    if info.server is None:
        raise ToolchainMissingError(f"engine {engine} has no OpenAI-compatible server in Quantyard",
                                    hint="serve a format whose engine has one (llama.cpp, vllm, exllamav2)")
    module, _, func = info.server.partition(":")
    return cast(Planner, getattr(import_module(module), func))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n_bytes: int = TAIL_BYTES) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - n_bytes))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _get(url: str, timeout_s: float = 2.0) -> int:
    """HTTP status of GET ``url`` (0 when nothing answered)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as res:
            return int(res.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return 0


class _PortTaken(Exception):
    pass


def _fail(spec: ServerSpec, what: str, log_path: Path, returncode: int | None = None) -> EngineError:
    return EngineError(f"{spec.engine} server for {spec.model} {what}", engine=str(spec.engine),
                       returncode=returncode, stderr_tail=_tail(log_path),
                       hint=f"read the server log {log_path}")


def wait_healthy(keeper: subprocess.Popen[bytes], base_url: str, plan: LaunchPlan, spec: ServerSpec,
                 log_path: Path) -> float:
    """Poll ``plan.health_path`` and then ``/v1/models`` until both answer 200; returns the seconds waited.

    Raises:
        EngineError: the server exited first, or did not answer within ``spec.start_timeout_s`` (with the
            log's tail).
        _PortTaken: it exited because the port was taken.
    """
    t0 = time.monotonic()
    while True:
        rc = keeper.poll()
        if rc is not None:
            if any(s in _tail(log_path).lower() for s in _PORT_TAKEN):
                raise _PortTaken()
            raise _fail(spec, f"exited with status {rc} before it became healthy", log_path, rc)
        if _get(base_url + plan.health_path) == 200 and _get(base_url + "/v1/models") == 200:
            return time.monotonic() - t0
        if time.monotonic() - t0 > spec.start_timeout_s:
            raise _fail(spec, f"did not become healthy within {spec.start_timeout_s:.0f} s", log_path)
        time.sleep(0.25)


def _served_name(spec: ServerSpec) -> str:
    return spec.model.stem if spec.model.is_file() else spec.model.name


@contextlib.contextmanager
def start_server(spec: ServerSpec, settings: Settings, log_dir: Path) -> Iterator[RunningServer]:
    """Start ``spec``'s server, yield it once healthy, stop it when the block ends (see the module doc).

    Stale servers of killed runs are swept first (:func:`supervise.sweep_stale_servers`). The log is
    ``log_dir/<engine>-<port>.log`` and is kept.

    Raises:
        EngineError: the server exited, never became healthy, or its log contradicts the plan.
        ToolchainMissingError: the engine or its server cannot run here (e.g. ExLlamaV2 without CUDA).
        ConfigError: the spec asks for what this machine cannot do (e.g. tensor parallel without GPUs).
    """
    supervise.sweep_stale_servers(settings.work_root)
    plan_for = planner(str(spec.engine))
    for attempt in range(PORT_ATTEMPTS):
        port = free_port()
        plan = plan_for(spec, settings, port)
        try:
            server = _start(spec, settings, plan, port, log_dir)
        except _PortTaken:
            if attempt + 1 == PORT_ATTEMPTS:
                raise EngineError(f"{spec.engine} server found its port taken {PORT_ATTEMPTS} times",
                                  engine=str(spec.engine), hint="free some ports and run again") from None
            continue
        break
    try:
        yield server
    finally:
        _shutdown(server)


def _start(spec: ServerSpec, settings: Settings, plan: LaunchPlan, port: int, log_dir: Path) -> RunningServer:
    """Launch ``plan`` under the keeper and return it healthy and measured; on any failure it is stopped."""
    weights = weights_bytes(spec.model)  # before the launch: a missing model fails here
    log_path = log_dir / f"{str(spec.engine).replace('.', '')}-{port}.log"
    device = DeviceMemory() if plan.device else None  # before the launch: its baseline
    base_url = f"http://{HOST}:{port}"
    t0 = time.monotonic()
    keeper = supervise.launch(settings.core_python, plan.command, plan.env, log_path)
    record: Path | None = None
    try:
        pid = supervise.server_pid(keeper)
        if pid is None:
            raise _fail(spec, "did not start (its keeper exited)", log_path, keeper.poll())
        record = supervise.record(settings.work_root, keeper, pid, str(spec.engine), base_url, log_path)
        wait_healthy(keeper, base_url, plan, spec, log_path)
        start_s = time.monotonic() - t0
        facts = plan.read_log(log_path.read_text(errors="replace"))
        if facts.problems:
            raise _fail(spec, "does not run as planned: " + "; ".join(facts.problems), log_path)
        sampler = MemorySampler(pid, device=device)
        after = sampler.snapshot()
        sampler.start()
    except BaseException:
        supervise.stop(keeper, spec.stop_grace_s)
        if record is not None:
            record.unlink(missing_ok=True)
        raise
    info = plan.info.model_copy(update={"flags": {**plan.info.flags, **facts.flags}})
    return RunningServer(spec=spec, info=info, base_url=base_url, model_name=_served_name(spec), pid=pid,
                         keeper_pid=keeper.pid, log_path=log_path, start_s=start_s,
                         weights_bytes=weights, after_load=after, facts=facts, sampler=sampler,
                         device_method=device.method if device is not None else None, _keeper=keeper,
                         _record=record)


def _shutdown(server: RunningServer) -> None:
    server.sampler.stop()
    strays = tree_pids(server.pid)
    if server._keeper is not None:
        supervise.stop(server._keeper, server.spec.stop_grace_s, strays)
    if server._record is not None:
        server._record.unlink(missing_ok=True)
