"""llama.cpp's OpenAI-compatible server: ``llama-server`` from the cached llama-cpp-python build
(``pipeline.llama_cpp``), launched by :func:`evaluators.serving.server.start_server` through :func:`plan`.

The command, and why:

* ``--parallel SLOTS -c SLOTS×CONTEXT --no-kv-unified``: each slot owns ``CONTEXT`` tokens of KV cache (llama.cpp
  pads it up to a multiple of 256); with one shared cache, slots can abort one another when it fills;
* ``-cb``: continuous batching (its default, said explicitly);
* ``--no-cache-prompt --cache-ram 0`` unless ``spec.prompt_cache``: a request's prompt is always prefilled, so
  TTFT is not understated by a cached prefix, and no prompt cache grows in RAM during the measurement;
* ``--threads/--threads-batch``, ``--metrics`` (the Prometheus ``/metrics`` endpoint), ``-ngl`` (all layers on a
  GPU, none on CPU unless ``spec.gpu_layers`` says), ``--split-mode``/``--tensor-split`` across GPUs,
  ``--fit off`` (nothing is resized behind our back), ``--no-webui``;
* ``-lv 4``: libllama's own info lines (the KV cache, the contexts) are at llama-server's trace level; they
  and a few lines per request go to the log.

:func:`read_log` takes, from the server's own log, the KV cache it allocated (``llama_kv_cache: size = … MiB
(N cells, …)``), the contexts it settled on (``n_ctx``, ``n_ctx_seq``) and the slots it initialized
(``n_slots``, ``n_ctx_slot``), and fails the start when a slot holds fewer tokens than asked (llama-server caps
a slot at the model's training context).
"""

from __future__ import annotations

import re

from evaluators.serving.spec import LaunchPlan, LogFacts, ServerSpec
from pipeline.config import Settings
from pipeline.envs import detect_accelerator
from pipeline.errors import ConfigError
from pipeline.llama_cpp import llama_cpp_toolchain
from pipeline.serving import ServerInfo

HOST = "127.0.0.1"
#: -ngl for "every layer" (llama.cpp clamps it to the model's layer count).
ALL_LAYERS = 999

_KV = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\), "
                 r"K \((\w+)\):\s*[\d.]+ MiB, V \((\w+)\)")
_N_CTX = re.compile(r"llama_context: n_ctx\s+= (\d+)")
_N_CTX_SEQ = re.compile(r"llama_context: n_ctx_seq\s+= (\d+)")
_SLOTS = re.compile(r"initializing, n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'")


def command(spec: ServerSpec, settings: Settings, port: int) -> tuple[list[str], dict[str, object]]:
    """The llama-server command line and the flags it sets (for :attr:`ServerInfo.flags`).

    Raises:
        ToolchainMissingError: this llama.cpp build has no llama-server.
        ConfigError: ``spec.tensor_parallel`` > 1 (llama.cpp splits with ``split_mode``/``tensor_split``).
    """
    if spec.tensor_parallel != 1:
        raise ConfigError("llama.cpp has no tensor_parallel setting: it splits a model across GPUs with "
                          "split_mode/tensor_split", hint="use split_mode='row' or 'tensor' and tensor_split")
    exe = llama_cpp_toolchain(settings).exe("llama-server")
    threads = spec.threads or settings.threads
    gpu = detect_accelerator(settings) == "cuda"
    ngl = spec.gpu_layers if spec.gpu_layers is not None else (ALL_LAYERS if gpu else 0)
    name = spec.model.stem
    cmd = [str(exe), "-m", str(spec.model), "--host", HOST, "--port", str(port), "--alias", name,
           "--parallel", str(spec.slots), "-c", str(spec.slots * spec.context), "--no-kv-unified", "-cb",
           "--threads", str(threads), "--threads-batch", str(threads), "-ngl", str(ngl), "--fit", "off",
           "--metrics", "--no-webui", "-lv", "4"]
    cmd += ["--cache-prompt"] if spec.prompt_cache else ["--no-cache-prompt", "--cache-ram", "0"]
    if spec.split_mode is not None:
        cmd += ["--split-mode", spec.split_mode]
    if spec.tensor_split is not None:
        cmd += ["--tensor-split", ",".join(f"{x:g}" for x in spec.tensor_split)]
    cmd += list(spec.extra_args)
    flags: dict[str, object] = {"threads": threads, "threads_batch": threads, "n_gpu_layers": ngl,
                                "cache_prompt": spec.prompt_cache, "cache_ram_mib": None if spec.prompt_cache else 0,
                                "kv_unified": False, "metrics_endpoint": "/metrics", "fit": "off",
                                "accelerator": "cuda" if gpu else "cpu", "extra_args": list(spec.extra_args)}
    return cmd, flags


def plan(spec: ServerSpec, settings: Settings, port: int) -> LaunchPlan:
    """How to start llama-server for ``spec`` on ``port`` (see the module doc).

    Raises:
        ToolchainMissingError: llama-cpp-python or its llama-server is not installed.
        ConfigError: ``spec.tensor_parallel`` > 1.
    """
    tc = llama_cpp_toolchain(settings)
    cmd, flags = command(spec, settings, port)
    info = ServerInfo(engine="llama.cpp", server="llama-server",
                      version=f"llama.cpp {tc.commit or 'unknown commit'} (llama-cpp-python {tc.wheel_version})",
                      command=cmd, parallel_slots=spec.slots, context_per_request=spec.context,
                      context_total=spec.slots * spec.context, continuous_batching=True, tensor_parallel=1,
                      parallelism={"split_mode": spec.split_mode, "tensor_split": spec.tensor_split,
                                   "n_gpu_layers": flags["n_gpu_layers"]},
                      flags=flags)
    return LaunchPlan(command=cmd, env=tc.env(), info=info, read_log=lambda text: read_log(text, spec),
                      health_path="/health", device=flags["accelerator"] == "cuda")


def read_log(text: str, spec: ServerSpec) -> LogFacts:
    """What llama-server's log says (see the module doc); ``problems`` when its slots are not those asked."""
    flags: dict[str, object] = {}
    problems: list[str] = []
    kv = [m.groups() for m in _KV.finditer(text)]
    for key, pattern in (("n_ctx", _N_CTX), ("n_ctx_seq", _N_CTX_SEQ)):
        m = pattern.search(text)
        if m:
            flags[key] = int(m.group(1))
    slots = _SLOTS.search(text)
    if slots:
        flags.update(n_slots=int(slots.group(1)), n_ctx_slot=int(slots.group(2)), kv_unified=slots.group(3) == "true")
        if int(slots.group(1)) != spec.slots:
            problems.append(f"llama-server initialized {slots.group(1)} slots, not {spec.slots}")
        if int(slots.group(2)) < spec.context:
            problems.append(f"a slot holds {slots.group(2)} tokens, fewer than the {spec.context} asked "
                            "(llama-server caps a slot at the model's training context)")
    else:
        problems.append("llama-server's log has no 'initializing, n_slots = …' line")
    if not kv:
        return LogFacts(kv_cache_source="llama-server's log has no 'llama_kv_cache: size = …' line",
                        flags=flags, problems=problems)
    flags.update(type_k=kv[0][5], type_v=kv[0][6])
    mib = sum(float(g[0]) for g in kv)
    tokens = sum(int(g[1]) * int(g[4]) for g in kv)  # cells per stream × streams (one per slot)
    lines = "; ".join(f"size = {g[0]} MiB ({g[1]} cells, {g[2]} layers, {g[3]}/{g[4]} seqs)" for g in kv)
    return LogFacts(kv_cache_bytes=round(mib * 2**20), kv_cache_tokens=tokens,
                    kv_cache_source=f"llama-server log 'llama_kv_cache: {lines}' (MiB to 2 decimals; tokens = cells "
                                    "per stream × streams)",
                    flags=flags, problems=problems)
