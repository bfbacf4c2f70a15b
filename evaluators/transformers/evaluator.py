"""Reference cross-check: transformers evaluates a quantized checkpoint on the same windows.

For AWQ the runner is ``evaluators.transformers.runner`` in the ``awq`` tool environment, whose
transformers + compressed-tensors decompress the checkpoint (``W = (q - z) * s`` per group) and run
it in float32. That gives a second perplexity of the same file, independent of vLLM's loader and
kernels; the two must agree (tests/evaluators/test_vllm.py checks within 0.5 %).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from evaluators.base import EvalOutcome, RunnerCommand, probe_windows, quality_request, run_engine, score
from pipeline import envs
from pipeline.config import Settings
from pipeline.errors import ToolchainMissingError
from pipeline.footprint import ModelFacts, Need, torch_forward
from pipeline.plan import EvalSpec
from pipeline.specs import Engine, QuantFormat

RUNNER = "evaluators.transformers.runner"
ENV = "awq"


class TransformersCheckEvaluator:
    engine: ClassVar[Engine] = Engine.TRANSFORMERS
    formats: ClassVar[frozenset[QuantFormat]] = frozenset({QuantFormat.AWQ})

    def unavailable_reason(self, settings: Settings) -> str | None:
        try:
            envs.python_for(ENV, settings)
        except ToolchainMissingError as exc:
            return exc.message
        return None

    @staticmethod
    def skip_reason(spec: dict[str, object]) -> str | None:
        """Why this check does not apply to a variant spec (None: it applies). transformers reads the
        compressed-tensors layout; the AutoAWQ GEMM layout needs AutoAWQ's kernels, absent there."""
        if spec.get("backend", "llmcompressor") != "llmcompressor":
            return "transformers in the awq environment cannot load the AutoAWQ GEMM layout"
        return None

    def memory_need(self, facts: ModelFacts, variant_bytes: int, variant: dict[str, Any], spec: EvalSpec,
                    settings: Settings) -> Need:
        """The model held whole in float32 on the CPU (pipeline/footprint.py)."""
        return torch_forward(facts, "float32", spec.window, "the transformers cross-check (float32, decompressed)")

    def probe(self, model: Path, *, out_dir: Path, settings: Settings) -> dict[str, Any]:
        """Load the folder with transformers in the awq environment and score one short window."""
        env = envs.ensure(ENV, settings)
        request = {"model": str(model), "windows": str(probe_windows(out_dir.parent)), "top_k": 4,
                   "threads": settings.threads, "dtype": "float32", "device": "cpu", "batch_size": 1}
        cmd = RunnerCommand(engine=self.engine, python=env.python, module=RUNNER,
                            env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        out = run_engine(cmd, request, out_dir, settings)
        return {"engine": self.engine.value, "engine_version": out.result["engine_version"],
                "load_and_eval_s": round(out.wall_s, 2)}

    def evaluate(self, model: Path, *, windows: Path, window_set_id: str, reference: Path, spec: EvalSpec,
                 out_dir: Path, settings: Settings) -> EvalOutcome:
        """Score an AWQ folder with transformers (float32, CPU) on the window set; no speed.

        Raises:
            EngineError: the runner failed (e.g. this transformers cannot load the layout).
        """
        env = envs.ensure(ENV, settings)
        request = {"model": str(model), "windows": str(windows), **quality_request(reference, spec),
                   "threads": settings.threads, "dtype": "float32", "device": "cpu", "batch_size": 4}
        cmd = RunnerCommand(engine=self.engine, python=env.python, module=RUNNER,
                            env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        out = run_engine(cmd, request, out_dir, settings)
        return EvalOutcome(engine=self.engine.value, engine_version=out.result["engine_version"],
                           hardware=out.result["hardware"], window_set_id=window_set_id,
                           quality=score(reference, out, self.engine, windows), speed=None, wall_s=out.wall_s,
                           environment=env.lineage())
