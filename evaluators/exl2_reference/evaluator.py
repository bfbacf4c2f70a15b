"""EXL2 reference evaluator (engine ``exl2-reference``): runs anywhere, in the core environment.

The transformers runner (``evaluators.transformers.runner`` with ``loader="exl2"``) loads the EXL2 folder by
dequantizing every layer with Quantyard's codec (``evaluators/exl2_loader.py``, designed bit-exact with
ExLlamaV2's reconstruction; whether that held on a GPU: ``pipeline/status.py``) and scores it in fp32 on the same
windows. It is a stand-in: fp32 transformers arithmetic, not ExLlamaV2's fp16 kernels. It measures what the
quantization did to the model; it reports no speed, since a dequantized transformers model says nothing about
ExLlamaV2's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from evaluators.base import EvalOutcome, RunnerCommand, probe_windows, quality_request, run_engine, score
from pipeline.config import Settings
from pipeline.footprint import ModelFacts, Need, torch_forward
from pipeline.plan import EvalSpec
from pipeline.specs import Engine, QuantFormat

#: The transformers engine's runner, by module name (a string: engine packages never import each other).
RUNNER = "evaluators.transformers.runner"


class EXL2ReferenceEvaluator:
    engine: ClassVar[Engine] = Engine.EXL2_REFERENCE
    formats: ClassVar[frozenset[QuantFormat]] = frozenset({QuantFormat.EXL2})

    def unavailable_reason(self, settings: Settings) -> str | None:
        return None  # torch and transformers are part of the core environment

    def memory_need(self, facts: ModelFacts, variant_bytes: int, variant: dict[str, Any], spec: EvalSpec,
                    settings: Settings) -> Need:
        """The model held whole in float32 on the CPU (pipeline/footprint.py)."""
        return torch_forward(facts, "float32", spec.window, "an EXL2 reference-codec evaluation (float32)")

    def probe(self, model: Path, *, out_dir: Path, settings: Settings) -> dict[str, Any]:
        """Dequantize every layer of the EXL2 folder ``model`` with the codec and score one short window
        (validate's loadability check). Raises EngineError when the folder does not load."""
        cmd = RunnerCommand(engine=self.engine, python=settings.core_python, module=RUNNER)
        request = {"model": str(model), "windows": str(probe_windows(out_dir.parent)), "top_k": 4,
                   "threads": settings.threads, "dtype": "float32", "device": "cpu", "loader": "exl2"}
        out = run_engine(cmd, request, out_dir, settings, timeout_s=600)
        return {"engine": self.engine.value, "engine_version": f"quantyard exl2 codec; {out.result['engine_version']}",
                "load_and_eval_s": round(out.wall_s, 2)}

    def evaluate(self, model: Path, *, windows: Path, window_set_id: str, reference: Path, spec: EvalSpec,
                 out_dir: Path, settings: Settings) -> EvalOutcome:
        """Dequantize the EXL2 folder ``model`` into transformers (fp32, CPU) and score it on the windows."""
        cmd = RunnerCommand(engine=self.engine, python=settings.core_python, module=RUNNER)
        request = {"model": str(model), "windows": str(windows), **quality_request(reference, spec),
                   "threads": settings.threads, "dtype": "float32", "device": "cpu", "loader": "exl2"}
        out = run_engine(cmd, request, out_dir, settings)
        quality = score(reference, out, self.engine, windows)
        version = f"quantyard exl2 codec; {out.result['engine_version']}"
        return EvalOutcome(engine=self.engine.value, engine_version=version,
                           hardware=out.result["hardware"], window_set_id=window_set_id, quality=quality,
                           speed=None, wall_s=out.wall_s)
