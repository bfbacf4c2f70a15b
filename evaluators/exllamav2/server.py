"""ExLlamaV2's OpenAI-compatible server for EXL2 variants (CUDA only), launched by
:func:`evaluators.serving.server.start_server` through :func:`plan`.

The server is Quantyard's own small app, ``python -m evaluators.exllamav2.openai_server`` in the ExLlamaV2
interpreter (evaluators/exllamav2/openai_server.py: FastAPI + uvicorn around exllamav2's dynamic generator),
since no maintained server serves EXL2 on a current stack (TabbyAPI's main branch serves ExLlamaV3 only). Its
cache holds ``slots`` × ``context`` tokens; it prints one ``quantyard-exl2-server:`` line with the cache it
allocated, which :func:`read_log` takes as the KV cache. Without CUDA it cannot run: :func:`plan` raises
:class:`~pipeline.errors.ToolchainMissingError` and no server is started.
"""

from __future__ import annotations

import json
from typing import Any

from evaluators.serving.spec import LaunchPlan, LogFacts, ServerSpec
from pipeline import exl2_env
from pipeline.config import Settings
from pipeline.errors import ToolchainMissingError
from pipeline.proc import child_env
from pipeline.serving import ServerInfo

HOST = "127.0.0.1"
APP = "evaluators.exllamav2.openai_server"
MARK = "quantyard-exl2-server:"


def plan(spec: ServerSpec, settings: Settings, port: int) -> LaunchPlan:
    """How to start the ExLlamaV2 server for ``spec`` on ``port`` (see the module doc).

    Raises:
        ToolchainMissingError: ExLlamaV2 cannot run here (no CUDA, or no ExLlamaV2 interpreter).
    """
    reason = exl2_env.unavailable_reason(settings)
    if reason is not None:
        raise ToolchainMissingError(
            f"ExLlamaV2 server unavailable here: ExLlamaV2 needs CUDA ({reason})",
            hint="serve EXL2 variants on a CUDA machine after `quantyard env ensure exl2` "
                 "(or set QUANTYARD_EXL2_PYTHON)")
    rt = exl2_env.require(settings)
    cmd = [rt.python, "-m", APP, "--model", str(spec.model), "--name", spec.model.name, "--host", HOST,
           "--port", str(port), "--slots", str(spec.slots), "--context", str(spec.context),
           "--tensor-parallel", str(spec.tensor_parallel)]
    if spec.tensor_split is not None:
        cmd += ["--gpu-split", ",".join(f"{x:g}" for x in spec.tensor_split)]
    cmd += list(spec.extra_args)
    flags: dict[str, Any] = {"accelerator": "cuda", "gpu": rt.gpu, "cache": "ExLlamaV2Cache (FP16)",
                             "cache_tokens_asked": spec.slots * spec.context, "prefix_caching":
                             "exllamav2 dynamic generator page reuse (always on; prompts must differ)",
                             "extra_args": list(spec.extra_args)}
    info = ServerInfo(engine="exllamav2", server="quantyard exllamav2 server (evaluators.exllamav2.openai_server)",
                      version=f"exllamav2 {rt.exllamav2}, torch {rt.torch}", command=cmd, parallel_slots=spec.slots,
                      context_per_request=spec.context, context_total=spec.slots * spec.context,
                      continuous_batching=True, tensor_parallel=spec.tensor_parallel,
                      parallelism={"tensor_parallel": spec.tensor_parallel, "gpu_split": spec.tensor_split},
                      flags=flags)
    return LaunchPlan(command=cmd, env=child_env({"PYTHONUNBUFFERED": "1"}), info=info, health_path="/health",
                      device=True, read_log=lambda text: read_log(text, spec))


def read_log(text: str, spec: ServerSpec) -> LogFacts:
    """The app's ``quantyard-exl2-server:`` line: cache bytes and tokens, paged attention, batch size;
    ``problems`` when it runs fewer slots or a smaller cache than asked."""
    line = next((ln.partition(MARK)[2] for ln in reversed(text.splitlines()) if MARK in ln), None)
    if line is None:
        return LogFacts(kv_cache_source="the server's log has no 'quantyard-exl2-server:' line",
                        problems=["the ExLlamaV2 server did not report its cache"])
    facts = json.loads(line)
    problems = []
    if int(facts["max_batch_size"]) < spec.slots:
        problems.append(f"the generator runs {facts['max_batch_size']} requests at once, not {spec.slots}")
    if int(facts["cache_tokens"]) < spec.slots * spec.context:
        problems.append(f"the cache holds {facts['cache_tokens']} tokens, fewer than {spec.slots} × {spec.context}")
    return LogFacts(kv_cache_bytes=int(facts["cache_bytes"]), kv_cache_tokens=int(facts["cache_tokens"]),
                    kv_cache_source="ExLlamaV2Cache.footprint() reported by the server at start",
                    flags={k: facts[k] for k in ("paged", "max_batch_size", "tp", "devices") if k in facts},
                    problems=problems)
