"""Orchestrator side of the engine protocol: start a runner, contain its failures, score its output.

See ``evaluators/protocol.py`` for the request and output formats.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from evaluators.metrics import compare
from evaluators.protocol import window_sizes
from evaluators.speed import SHAPE_KEYS, resolve_shape
from pipeline.config import Settings
from pipeline.errors import EngineError
from pipeline.footprint import ModelFacts, Need
from pipeline.plan import EvalSpec
from pipeline.proc import child_env, failure_log_dir, keep_failed, run_logged
from pipeline.progress import runner_line
from pipeline.results import EvalResult
from pipeline.specs import Engine, QuantFormat


@dataclass(frozen=True)
class RunnerCommand:
    """How to start one engine's runner: which interpreter, which module, which environment."""

    engine: Engine
    python: str
    module: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class RunnerOutput:
    result: dict[str, Any]
    arrays: Path | None  # logprobs.npz, when quality was requested
    wall_s: float


@dataclass
class EvalOutcome:
    """What an evaluation of one variant on one engine produced (metrics already computed)."""

    engine: str
    engine_version: str
    hardware: dict[str, Any]
    window_set_id: str | None
    quality: dict[str, Any] | None
    speed: dict[str, Any] | None
    wall_s: float
    fallback: str | None = None  # set when a reference engine stood in for the real one
    environment: dict[str, Any] | None = None  # the tool environment (EnvInfo.lineage(): exact pip freeze)

    def records(self) -> list[EvalResult]:
        """Registry results (one for quality, one for speed); a tool environment's record (exact
        ``pip freeze``) is kept with the hardware it ran on."""
        hardware = {**self.hardware, "environment": self.environment} if self.environment else self.hardware
        out = []
        if self.quality is not None:
            metrics = {**self.quality, **({"fallback": self.fallback} if self.fallback else {})}
            out.append(EvalResult(kind="quality", engine=self.engine, engine_version=self.engine_version,
                                  window_set_id=self.window_set_id, metrics=metrics, hardware=hardware,
                                  wall_s=self.wall_s))
        if self.speed is not None:
            out.append(EvalResult(kind="speed", engine=self.engine, engine_version=self.engine_version,
                                  metrics=self.speed, hardware=hardware, wall_s=self.wall_s))
        return out


def run_runner(cmd: RunnerCommand, request: dict[str, Any], out_dir: Path, timeout_s: float,
               keep_logs: Path | None = None) -> RunnerOutput:
    """Run a runner to completion. When it fails, its logs are copied to ``keep_logs`` (normally
    ``failure_log_dir(settings.logs_root)``) and the error's hint names that copy, which outlives ``out_dir``.

    Raises:
        EngineError: the runner crashed, was killed (OOM, SIGKILL), timed out, or wrote no result.
    """
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    req_path = out_dir / "request.json"
    req_path.write_text(json.dumps({**request, "out_dir": str(out_dir)}, indent=2))
    env = child_env(cmd.env)
    started = time.perf_counter()
    res = run_logged([cmd.python, "-m", cmd.module, str(req_path)], log_dir=out_dir, name="runner",
                     timeout_s=timeout_s, env=env, keep=keep_logs, progress=runner_line)
    result_path = out_dir / "result.json"
    if res.ok and not result_path.is_file() and keep_logs is not None:
        res = keep_failed(res, out_dir, "runner", keep_logs)
    if not res.ok or not result_path.is_file():
        how = res.describe() if not res.ok else "exited without writing result.json"
        raise EngineError(f"{cmd.engine.value} runner {how}", engine=cmd.engine.value, returncode=res.returncode,
                          stderr_tail=res.stderr_tail, hint=f"full log: {res.log}")
    arrays = out_dir / "logprobs.npz"
    return RunnerOutput(result=json.loads(result_path.read_text()), arrays=arrays if arrays.is_file() else None,
                        wall_s=time.perf_counter() - started)


def run_engine(cmd: RunnerCommand, request: dict[str, Any], out_dir: Path, settings: Settings,
               timeout_s: float | None = None) -> RunnerOutput:
    """:func:`run_runner` with the settings' engine timeout, keeping a failed runner's logs under
    ``settings.logs_root`` (see pipeline.proc.failure_log_dir)."""
    return run_runner(cmd, request, out_dir, settings.engine_timeout_s if timeout_s is None else timeout_s,
                      keep_logs=failure_log_dir(settings.logs_root))


#: Members of a reference's npz that stay on disk (the whole distribution, read memory-mapped by runners).
FULL_MEMBERS = frozenset({"full_codes"})


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """Every array of a runner's npz but the whole stored distribution (see ``FULL_MEMBERS``)."""
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files if k not in FULL_MEMBERS}


def quality_request(reference: Path, spec: EvalSpec) -> dict[str, Any]:
    """The request keys that score a variant against ``reference``: the exact KLD (``kld="full"``) unless the
    plan asks for the cheaper top-K lower bound."""
    return {"reference": str(reference), "kld": "topk" if spec.kld == "topk_lower_bound" else "full",
            "top_k": spec.top_k}


def score(reference: Path, output: RunnerOutput, engine: Engine, windows: Path | None = None) -> dict[str, Any]:
    """Metrics of a runner's output against the reference file (see evaluators.metrics.compare), with the
    window bootstrap over ``windows``' windows, and the reference's identity.

    Raises:
        EngineError: the runner wrote no log-probs.
    """
    if output.arrays is None:
        raise EngineError(f"{engine.value} runner wrote no log-probs", engine=engine.value)
    ref = load_arrays(reference)
    q = load_arrays(output.arrays)
    metrics = compare(ref, q, window_sizes(windows) if windows is not None else None)
    metrics.update({k: v for k, v in output.result.get("quality", {}).items() if k not in metrics})
    if "full_step" in ref and metrics.get("kld_method") == "full-vocabulary":
        metrics["ref_logprob_step_max"] = float(np.max(ref["full_step"]))
    return metrics


def speed_request(spec: EvalSpec, accelerator: str) -> dict[str, Any] | None:
    """The ``speed`` part of a runner request (None when speed is off): the plan's shape for an engine running
    on ``accelerator`` (``cuda`` or ``cpu``), as :func:`evaluators.speed.resolve_shape` resolves and labels
    it, for every engine alike."""
    s = spec.speed
    if not s.enabled:
        return None
    return resolve_shape(s.model_dump(include={"repeats", "parallel", "cpu_scaled", *SHAPE_KEYS}), accelerator)


def probe_windows(folder: Path) -> Path:
    """A tiny window file (ids 3..66, no BOS) for loadability probes: any vocabulary has these ids."""
    from evaluators.windows import cut_windows

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "probe-windows.npz"
    cut_windows(list(range(3, 67)), window=32, stride=32, bos_id=None).save(path)
    return path


class Evaluator(Protocol):
    """One engine. Implementations are listed in ``evaluators/engines.py``."""

    engine: ClassVar[Engine]
    formats: ClassVar[frozenset[QuantFormat]]

    def unavailable_reason(self, settings: Settings) -> str | None:
        """None when this engine can run here, else why not (shown in listings)."""
        ...

    def evaluate(self, model: Path, *, windows: Path, window_set_id: str, reference: Path, spec: EvalSpec,
                 out_dir: Path, settings: Settings) -> EvalOutcome: ...

    def probe(self, model: Path, *, out_dir: Path, settings: Settings) -> dict[str, Any]:
        """Load the model and run one short window (validate's loadability check)."""
        ...

    def memory_need(self, facts: ModelFacts, variant_bytes: int, variant: dict[str, Any], spec: EvalSpec,
                    settings: Settings) -> Need:
        """ESTIMATE of the host memory one evaluation of a variant of ``variant_bytes`` (its spec ``variant``)
        holds at its peak (pipeline/footprint.py); the pre-flight compares it with the machine."""
        ...
