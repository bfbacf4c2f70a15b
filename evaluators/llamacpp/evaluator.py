"""llama.cpp evaluator: GGUF variants on llama-cpp-python, in the core environment's interpreter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from evaluators.base import EvalOutcome, RunnerCommand, probe_windows, run_engine, score, speed_request
from pipeline.config import Settings
from pipeline.plan import EvalSpec
from pipeline.proc import child_env, with_path_prefix
from pipeline.specs import Engine, QuantFormat

RUNNER = "evaluators.llamacpp.runner"


def _bin_dir() -> Path:
    from importlib import metadata

    return Path(str(metadata.distribution("llama_cpp_python").locate_file("bin")))


class LlamaCppEvaluator:
    engine: ClassVar[Engine] = Engine.LLAMA_CPP
    formats: ClassVar[frozenset[QuantFormat]] = frozenset({QuantFormat.GGUF})

    def unavailable_reason(self, settings: Settings) -> str | None:
        from importlib import metadata

        try:
            metadata.version("llama_cpp_python")
        except metadata.PackageNotFoundError:
            return "llama-cpp-python is not installed (run `make setup`)"
        return None

    def _command(self, settings: Settings) -> RunnerCommand:
        env = with_path_prefix(child_env(), "LD_LIBRARY_PATH", _bin_dir().parent / "lib")
        return RunnerCommand(engine=self.engine, python=settings.core_python, module=RUNNER,
                             env={"LD_LIBRARY_PATH": env["LD_LIBRARY_PATH"]})

    def probe(self, model: Path, *, out_dir: Path, settings: Settings) -> dict[str, Any]:
        """Load the model and run one short window (loadability); returns engine version and timing."""
        windows = probe_windows(out_dir.parent)
        request = {"model": str(model), "windows": str(windows), "ref_topk": None, "top_k": 4,
                   "threads": settings.threads}
        out = run_engine(self._command(settings), request, out_dir, settings, timeout_s=600)
        return {"engine": self.engine.value, "engine_version": out.result["engine_version"],
                "load_and_eval_s": round(out.wall_s, 2)}

    def measure_speed(self, model: Path, *, spec: EvalSpec, out_dir: Path,
                      settings: Settings) -> tuple[dict[str, Any], dict[str, Any], str]:
        """Speed only (no quality pass): returns (speed metrics, hardware, engine version)."""
        speed = speed_request(spec) or {}
        speed["bin_dir"] = str(_bin_dir())
        out = run_engine(self._command(settings), {"model": str(model), "windows": None, "threads": settings.threads,
                                                   "speed": speed}, out_dir, settings)
        return out.result["speed"], out.result["hardware"], out.result["engine_version"]

    def evaluate(self, model: Path, *, windows: Path, window_set_id: str, reference: Path, spec: EvalSpec,
                 out_dir: Path, settings: Settings) -> EvalOutcome:
        """Score a GGUF file (the first part, for split GGUFs) on the window set, then time it."""
        speed = speed_request(spec)
        bin_dir = _bin_dir()
        if speed is not None:
            speed["bin_dir"] = str(bin_dir)
        commit = None
        meta = settings.llama_cpp_tools_dir / "toolchain.json"
        if meta.is_file():
            commit = json.loads(meta.read_text()).get("llama_cpp_commit")
        cmd = self._command(settings)
        request = {"model": str(model), "windows": str(windows), "ref_topk": str(reference), "top_k": spec.top_k,
                   "threads": settings.threads, "speed": speed, "llama_cpp_commit": commit}
        out = run_engine(cmd, request, out_dir, settings)
        quality = score(reference, out, self.engine)
        return EvalOutcome(engine=self.engine.value, engine_version=out.result["engine_version"],
                           hardware=out.result["hardware"], window_set_id=window_set_id, quality=quality,
                           speed=out.result.get("speed"), wall_s=out.wall_s)
