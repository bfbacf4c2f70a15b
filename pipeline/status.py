"""What has run where: the one table the documentation, ``quantyard doctor`` and docstrings refer to.

Every path that needs hardware this project's machines do not have (a CUDA GPU) is a row here with what happened
when it last ran, the evidence (a file in bench/results/) and the command that checks it. A docstring that
describes such a path says "see pipeline/status.py", never a status of its own (the statuses it used to carry went
stale: the EXL2 codec parity check was still described as not run after it had run on an H200 and failed).

Change a row only with its evidence: a new result file, or a run's log committed beside the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RunStatus(StrEnum):
    PASSED = "ran, passed"
    FAILED = "ran, FAILED"
    PARTLY = "ran, partly passed"
    PREPARED = "prepared, never run"


@dataclass(frozen=True)
class PathStatus:
    """One GPU path: what it is, how it last went, the evidence, and the command that checks it."""

    path: str
    status: RunStatus
    detail: str
    evidence: str | None  # a file in bench/results/
    check: str


GPU_EVIDENCE = "gpu_check_h200_2026-12-04.txt"

#: Every GPU path of the product. The lent machines so far: one H200, 15 minutes, on 2026-12-04.
GPU_PATHS: tuple[PathStatus, ...] = (
    PathStatus("ExLlamaV2 conversion (exllamav2 backend)", RunStatus.PASSED,
               "the demo measured once and converted at 3.0, 4.0 and 6.0 bpw through Quantyard's converter",
               GPU_EVIDENCE, "bash scripts/gpu-check.sh run-all (tests/converters/test_exl2_gpu.py)"),
    PathStatus("ExLlamaV2 evaluation (PPL, exact KLD, speed)", RunStatus.FAILED,
               "failed for a file the reference codec wrote; the run was cut before a file exllamav2 wrote was "
               "evaluated; tracebacks lost, cause unknown",
               GPU_EVIDENCE, "bash scripts/gpu-check.sh run-all (tests/evaluators/test_exl2_gpu.py)"),
    PathStatus("EXL2 codec bit for bit against ExLlamaV2's reconstruction", RunStatus.FAILED,
               "failed; a cause found since on CPU (ExLlamaV2 keeps down_proj unpermuted and reorders gate/up "
               "columns instead), fixed in the test, not re-run on a GPU",
               GPU_EVIDENCE, "bash scripts/gpu-check.sh run-all (tests/converters/test_exl2_gpu.py)"),
    PathStatus("transformers reference on CUDA (bf16 on one GPU)", RunStatus.PASSED,
               "KL to the CPU float32 reference 3.54e-06", GPU_EVIDENCE,
               "bash scripts/gpu-check.sh run-all (tests/evaluators/test_reference_gpu.py)"),
    PathStatus("transformers reference over every GPU (fp32, device_map auto)", RunStatus.FAILED,
               "failed on the devices' naming; fixed since, not re-run", GPU_EVIDENCE,
               "bash scripts/gpu-check.sh run-all (tests/evaluators/test_reference_gpu.py)"),
    PathStatus("vLLM on CUDA: AWQ evaluation with the in-process logits capture", RunStatus.PREPARED,
               "its wheel cannot travel to a lent machine (64 MiB carry limit)", None,
               "pytest -m gpu tests/evaluators/test_vllm_gpu.py on a CUDA machine with the vllm environment"),
    PathStatus("llm-compressor AWQ calibration on CUDA", RunStatus.PREPARED, "", None,
               "bash scripts/gpu-check.sh run (tests/converters/test_awq_gpu.py)"),
    PathStatus("serving on a GPU (ExLlamaV2's and vLLM's OpenAI servers, seed profile, TP=1 vs TP=N)",
               RunStatus.PREPARED, "its CPU dry run ran (SERVING_CHECK_DRY=1 bash scripts/gpu-check-serving.sh)", None,
               "bash scripts/gpu-check.sh run-serving"),
)


def status_of(path: str) -> PathStatus:
    """The row whose path starts with ``path``. Raises KeyError naming the paths there are."""
    for row in GPU_PATHS:
        if row.path.startswith(path):
            return row
    raise KeyError(f"no GPU path {path!r}; known: {', '.join(r.path for r in GPU_PATHS)}")


def markdown_table() -> str:
    """The table as Markdown (docs/hardware.md renders it; scripts/docs.py checks it)."""
    out = ["| path | status | what happened | evidence | check |", "|---|---|---|---|---|"]
    for r in GPU_PATHS:
        evidence = f"`bench/results/{r.evidence}`" if r.evidence else "—"
        out.append(f"| {r.path} | **{r.status.value}** | {r.detail or '—'} | {evidence} | `{r.check}` |")
    return "\n".join(out)
