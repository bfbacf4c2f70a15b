"""SIGKILL `quantyard convert` at several points; re-running completes, reuses every finished step, and the
registry verifies clean. The CLI runs as a real subprocess; children die with it (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import workdir
from pipeline.errors import WorkInUseError
from registry import open_registry
from tests.conftest import procs_where

TYPES = "Q8_0,Q4_K_M"
# every engine's runner runs as `python -m evaluators.<engine>.runner`
OUR_CHILDREN = (b"convert_hf_to_gguf.py", b"converters.gguf.workers", b"converters.awq.workers",
                b"converters.exl2.workers", b"evaluators.llamacpp.runner",
                b"evaluators.vllm.runner", b"evaluators.exllamav2.runner", b"evaluators.transformers.runner")


def _children_matching(marker: bytes, tag: str) -> list[int]:
    pids = []
    for pid in _tagged(tag):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            continue
    return pids


def _tagged(tag: str) -> list[int]:
    """Processes whose environment carries this test's tag (the CLI and everything it started)."""
    return procs_where("environ", lambda env: f"QUANTYARD_TEST_TAG={tag}".encode() in env)


def _env(tmp: Path) -> dict[str, str]:
    """The CLI's environment: the session's Prefect server (so no run pays for starting an embedded one)."""
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ)
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    env.update({"QUANTYARD_WORK_DIR": str(tmp / "work"), "QUANTYARD_THREADS": "2", "QUANTYARD_TEST_TAG": tmp.name,
                "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PREFECT_LOGGING_LEVEL": "INFO"})
    return env


def _cmd(demo: Path, registry: Path) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "convert", str(demo), "--gguf", TYPES, "--name", "demo",
            "--registry", str(registry), "--max-windows", "6", "--no-speed", "--json"]


def _run_and_kill(cmd: list[str], env: dict[str, str], *, child: bytes | None = None,
                  log_line: str | None = None, timeout: float = 900, at_kill: Callable[[], None] | None = None) -> str:
    """Start the CLI; SIGKILL it as soon as ``child`` runs or ``log_line`` is logged (``at_kill`` runs just
    before). Returns the output."""
    log = Path(env["QUANTYARD_WORK_DIR"]).parent / f"kill-{time.time_ns()}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            hit = (child is not None and _children_matching(child, env["QUANTYARD_TEST_TAG"])) or \
                  (log_line is not None and log_line in log.read_text(errors="replace"))
            if hit:
                if at_kill is not None:
                    at_kill()
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        proc.wait()
    text = log.read_text(errors="replace")
    assert proc.returncode == -signal.SIGKILL, f"the run was not killed at the intended point:\n{text[-3000:]}"
    time.sleep(1.0)
    tag = env["QUANTYARD_TEST_TAG"]
    ours = [m for m in OUR_CHILDREN if _children_matching(m, tag)]
    assert not ours, f"children outlived the killed flow: {ours}"
    return text


def _complete(cmd: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout[out.stdout.index("{"):])


def _verify(registry: Path, env: dict[str, str]) -> None:
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "registry", "verify", "--deep", "--registry",
                          str(registry)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture
def reap(tmp_path: Path):
    """Anything a killed run left behind (an embedded Prefect server outlives a SIGKILLed client): reap it."""
    yield
    for pid in _tagged(tmp_path.name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_kill_at_each_stage_then_resume(tmp_path: Path, demo_model: Path, prefect_harness: None, reap: None) -> None:
    registry = tmp_path / "registry"
    env = _env(tmp_path)
    cmd = _cmd(demo_model, registry)

    # 1. during the F16 conversion: nothing is registered (the source's stages are recorded with the first build);
    # the running flow holds the work folder's lease (`quantyard work prune` is refused), the killed one does not
    def prune_is_refused() -> None:
        with pytest.raises(WorkInUseError):
            workdir.prune(work, 0)

    work = Path(env["QUANTYARD_WORK_DIR"])
    _run_and_kill(cmd, env, child=b"convert_hf_to_gguf.py", at_kill=prune_is_refused)
    assert not (registry / "registry.db").exists() or open_registry(str(registry)).list_models() == []
    assert workdir.prune(work, 365) == []  # the lease went with the killed process (nothing is that old)

    # 2. during quantization of the second type: the first is registered, the base is cached
    _run_and_kill(cmd, env, child=b"converters.gguf.workers.quantize")
    # 3. during registration: the register task starts as soon as the build task has finished
    _run_and_kill(cmd, env, log_line="Task run 'build:Q4_K_M' - Finished")
    # 4. during evaluation
    _run_and_kill(cmd, env, child=b"evaluators.llamacpp.runner")

    report = _complete(cmd, env)
    events = report["events"]
    assert report["stages"][1]["stage"] == "prepare:gguf" and report["stages"][1]["status"] == "reused"
    assert not [e for e in events if e.startswith("convert_base")], events  # the base survived the kills
    variants = {v["variant"]: v for v in report["variants"]}
    assert all(v["eval_status"] in ("ok", "reused") for v in variants.values()), variants
    versions = {v.name: v.versions for v in open_registry(str(registry)).list_variants("demo")}
    assert versions == {"Q8_0": [1], "Q4_K_M": [1]}, versions
    _verify(registry, env)

    # a final re-run recomputes nothing at all
    again = _complete(cmd, env)
    assert [e for e in again["events"] if not e.startswith("reuse:")] == []
    leftovers = [p for p in (tmp_path / "work").rglob("*") if p.name.endswith(".incomplete")]
    assert not leftovers and not any((tmp_path / "work" / "staging").iterdir())
