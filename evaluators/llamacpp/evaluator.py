"""llama.cpp evaluator: GGUF variants on llama-cpp-python, in the core environment's interpreter."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from evaluators.base import EvalOutcome, RunnerCommand, probe_windows, quality_request, run_engine, score, speed_request
from pipeline.config import Settings
from pipeline.footprint import ModelFacts, Need, llama_cpp_run
from pipeline.llama_cpp import LlamaCppToolchain, llama_cpp_toolchain
from pipeline.llama_cpp import unavailable_reason as llama_cpp_unavailable
from pipeline.plan import EvalSpec
from pipeline.specs import Engine, QuantFormat

RUNNER = "evaluators.llamacpp.runner"
#: The core environment's llama-cpp-python is a CPU build (no layers offloaded): speed takes the CPU shape.
ACCELERATOR = "cpu"


class LlamaCppEvaluator:
    engine: ClassVar[Engine] = Engine.LLAMA_CPP
    formats: ClassVar[frozenset[QuantFormat]] = frozenset({QuantFormat.GGUF})

    def unavailable_reason(self, settings: Settings) -> str | None:
        return llama_cpp_unavailable(settings)

    def memory_need(self, facts: ModelFacts, variant_bytes: int, variant: dict[str, Any], spec: EvalSpec,
                    settings: Settings) -> Need:
        """The GGUF memory-mapped; a quantized type's repacked weights, the KV cache of the longest sequence run
        (a window, or the speed run's parallel sequences), the compute buffer and logits (footprint.llama_cpp_run)."""
        quantized = str(variant.get("type", "")) not in ("F32", "F16", "BF16")
        context = spec.window
        shape = speed_request(spec, ACCELERATOR)
        if shape is not None:
            n = max((int(p) for p in shape.get("parallel", ()) or (1,)), default=1)
            context = max(context, shape["prompt_tokens"] + shape["gen_tokens"],
                          n * (shape["parallel_prompt_tokens"] + shape["parallel_gen_tokens"]))
        return llama_cpp_run(facts, variant_bytes, quantized, spec.window, "an evaluation on llama.cpp", context)

    def _command(self, settings: Settings, tools: LlamaCppToolchain) -> RunnerCommand:
        return RunnerCommand(engine=self.engine, python=settings.core_python, module=RUNNER,
                             env={"LD_LIBRARY_PATH": tools.env()["LD_LIBRARY_PATH"]})

    def probe(self, model: Path, *, out_dir: Path, settings: Settings) -> dict[str, Any]:
        """Load the model and run one short window (loadability); returns engine version and timing."""
        windows = probe_windows(out_dir.parent)
        request = {"model": str(model), "windows": str(windows), "top_k": 4,
                   "threads": settings.threads}
        tools = llama_cpp_toolchain(settings)
        out = run_engine(self._command(settings, tools), request, out_dir, settings, timeout_s=600)
        return {"engine": self.engine.value, "engine_version": out.result["engine_version"],
                "load_and_eval_s": round(out.wall_s, 2)}

    def measure_speed(self, model: Path, *, spec: EvalSpec, out_dir: Path,
                      settings: Settings) -> tuple[dict[str, Any], dict[str, Any], str]:
        """Speed only (no quality pass): returns (speed metrics, hardware, engine version)."""
        tools = llama_cpp_toolchain(settings)
        request = {"model": str(model), "windows": None, "threads": settings.threads,
                   "speed": speed_request(spec, ACCELERATOR), "llama_cpp_commit": tools.commit}
        out = run_engine(self._command(settings, tools), request, out_dir, settings)
        return out.result["speed"], out.result["hardware"], out.result["engine_version"]

    def evaluate(self, model: Path, *, windows: Path, window_set_id: str, reference: Path, spec: EvalSpec,
                 out_dir: Path, settings: Settings) -> EvalOutcome:
        """Score a GGUF file (the first part, for split GGUFs) on the window set, then time it."""
        tools = llama_cpp_toolchain(settings)
        speed = speed_request(spec, ACCELERATOR)
        cmd = self._command(settings, tools)
        request = {"model": str(model), "windows": str(windows), **quality_request(reference, spec),
                   "threads": settings.threads, "speed": speed, "llama_cpp_commit": tools.commit}
        out = run_engine(cmd, request, out_dir, settings)
        quality = score(reference, out, self.engine, windows)
        return EvalOutcome(engine=self.engine.value, engine_version=out.result["engine_version"],
                           hardware=out.result["hardware"], window_set_id=window_set_id, quality=quality,
                           speed=out.result.get("speed"), wall_s=out.wall_s)
