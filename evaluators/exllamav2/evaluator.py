"""ExLlamaV2 evaluator (engine ``exllamav2``): EXL2 variants on the real engine, on CUDA, in the ExLlamaV2
interpreter (``evaluators/exllamav2/runner.py``): log-probs on the shared windows, and speed (time to first
token, decode tok/s at batch 1, the dynamic generator at N concurrent sequences). Where it cannot run, the
``exl2-reference`` engine (``evaluators/exl2_reference/``) stands in. A GPU path: what it has shown on a GPU, and
what not, is recorded in ``pipeline/status.py``, not here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from evaluators.base import EvalOutcome, RunnerCommand, probe_windows, quality_request, run_engine, score, speed_request
from pipeline import exl2_env
from pipeline.config import Settings
from pipeline.footprint import TORCH_PROCESS, ModelFacts, Need, logits_bytes
from pipeline.plan import EvalSpec
from pipeline.specs import Engine, QuantFormat

RUNNER = "evaluators.exllamav2.runner"


class ExLlamaV2Evaluator:
    engine: ClassVar[Engine] = Engine.EXLLAMAV2
    formats: ClassVar[frozenset[QuantFormat]] = frozenset({QuantFormat.EXL2})

    def unavailable_reason(self, settings: Settings) -> str | None:
        return exl2_env.unavailable_reason(settings)

    def memory_need(self, facts: ModelFacts, variant_bytes: int, variant: dict[str, Any], spec: EvalSpec,
                    settings: Settings) -> Need:
        """ExLlamaV2 runs on a CUDA GPU: the host holds the interpreter and the captured logits."""
        return Need.of("an evaluation on ExLlamaV2 (CUDA: weights on the GPU)", ("logits", logits_bytes(facts,
                       spec.window)), ("interpreter", TORCH_PROCESS))

    def probe(self, model: Path, *, out_dir: Path, settings: Settings) -> dict[str, Any]:
        """Load the EXL2 folder ``model`` in ExLlamaV2 on CUDA and score one short window.

        Raises ToolchainMissingError when ExLlamaV2 cannot run here, EngineError when the folder does not load.
        """
        rt = exl2_env.require(settings)
        cmd = RunnerCommand(engine=self.engine, python=rt.python, module=RUNNER)
        request = {"model": str(model), "windows": str(probe_windows(out_dir.parent)), "top_k": 4,
                   "threads": settings.threads, "speed": None}
        out = run_engine(cmd, request, out_dir, settings, timeout_s=600)
        return {"engine": self.engine.value, "engine_version": out.result["engine_version"],
                "load_and_eval_s": round(out.wall_s, 2)}

    def evaluate(self, model: Path, *, windows: Path, window_set_id: str, reference: Path, spec: EvalSpec,
                 out_dir: Path, settings: Settings) -> EvalOutcome:
        """Score the EXL2 folder ``model`` with ExLlamaV2 on CUDA, then time it.

        Raises ToolchainMissingError when ExLlamaV2 cannot run here, EngineError when its runner fails.
        """
        rt = exl2_env.require(settings)
        cmd = RunnerCommand(engine=self.engine, python=rt.python, module=RUNNER)
        request = {"model": str(model), "windows": str(windows), **quality_request(reference, spec),
                   "threads": settings.threads, "speed": speed_request(spec, "cuda")}
        out = run_engine(cmd, request, out_dir, settings)
        quality = score(reference, out, self.engine, windows)
        return EvalOutcome(engine=self.engine.value, engine_version=out.result["engine_version"],
                           hardware=out.result["hardware"], window_set_id=window_set_id, quality=quality,
                           speed=out.result.get("speed"), wall_s=out.wall_s)
