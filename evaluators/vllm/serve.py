"""vLLM's OpenAI-compatible server with Quantyard's 4-bit kernel choice installed in every vLLM process. Run as
``python -m evaluators.vllm.serve [vllm serve arguments]`` in the ``vllm`` tool environment (evaluators/vllm/server.py
builds the command).

On CPU, ``QUANTYARD_VLLM_CPU_WNA16`` (auto | native | dequantized) names the kernel rule of
:func:`evaluators.vllm.runner.wna16_kernel`: vLLM's native ``cpu_gemm_wna16`` where this CPU's build has it,
else (or when forced) the dequantizing replacement, which patches vLLM's ``CPUWNA16LinearKernel`` in the process
that imports it. vLLM's API server runs the engine core in a child process started by multiprocessing (spawn
on CPU), and spawn re-imports this module there as ``__mp_main__``: so the kernel is installed at import,
at module level, and every process prints ``quantyard-serve: {"role", "pid", "kernel", ...}`` on stderr for
the launcher to check (role ``api-server`` here, ``spawned`` in the processes vLLM spawns: the engine core among them).

The server itself is ``vllm.entrypoints.openai.api_server`` run as ``__main__`` in this process, exactly as
``python -m vllm.entrypoints.openai.api_server`` would run it, but without replacing this module as
``__main__`` (``alter_sys=False``), so that vLLM's children still re-import this one. On a GPU nothing is
patched: ``QUANTYARD_VLLM_CPU_WNA16`` is not set and this module only starts the server.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Any

ENV = "QUANTYARD_VLLM_CPU_WNA16"
MARK = "quantyard-serve:"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def install_kernel() -> dict[str, Any] | None:
    """Install the 4-bit kernel ``QUANTYARD_VLLM_CPU_WNA16`` names, in this process, and say so on stderr;
    None (nothing done) when the variable is not set."""
    mode = os.environ.get(ENV)
    if not mode:
        return None
    from evaluators.vllm.runner import wna16_kernel

    kernel = wna16_kernel(mode)
    role = "api-server" if __name__ == "__main__" else "spawned"
    print(MARK, json.dumps({"role": role, "pid": os.getpid(), "kernel": kernel["kernel"], "kernel_name": kernel["name"],
                            "mode": mode, "native_available": kernel["native_available"]}),
          file=sys.stderr, flush=True)
    return kernel


#: Installed at import: here, and in every process multiprocessing spawns from this one (see the module doc).
KERNEL = install_kernel()


def main() -> None:
    """Run vLLM's OpenAI API server with this process's arguments."""
    sys.argv[0] = SERVER_MODULE
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
