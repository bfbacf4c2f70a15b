"""Where the ExLlamaV2 interpreter is and whether it can run here (CUDA present, exllamav2 installed).

ExLlamaV2 JIT-compiles a CUDA extension when imported, so it lives in its own interpreter
(``QUANTYARD_EXL2_PYTHON``, else the managed ``exl2`` environment of ``pipeline/envs.py``)
and is only ever started as a subprocess. The probe below runs in that interpreter *without*
importing exllamav2: it reads its installed version and asks torch whether CUDA is usable.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pipeline.config import Settings
from pipeline.errors import ToolchainMissingError

_PROBE = """
import json, importlib.metadata as md
out = {}
try:
    out["exllamav2"] = md.version("exllamav2")
except md.PackageNotFoundError:
    out["exllamav2"] = None
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = bool(torch.cuda.is_available())
    out["gpu"] = torch.cuda.get_device_name(0) if out["cuda"] else None
except Exception as exc:
    out["torch"], out["cuda"], out["gpu"], out["error"] = None, False, None, repr(exc)
print(json.dumps(out))
"""


@dataclass(frozen=True)
class EXL2Runtime:
    python: str
    exllamav2: str | None
    torch: str | None
    cuda: bool
    gpu: str | None
    error: str | None = None

    @property
    def unavailable_reason(self) -> str | None:
        if self.error and not self.torch:
            return f"{self.python} cannot import torch: {self.error}"
        if self.exllamav2 is None:
            return f"exllamav2 is not installed in {self.python}"
        if not self.cuda:
            return f"no CUDA device visible to {self.python} (ExLlamaV2 needs one)"
        return None


@lru_cache(maxsize=8)
def probe(python: str, timeout_s: float = 120.0) -> EXL2Runtime:
    """Ask ``python`` for its exllamav2 and torch versions and CUDA availability (cached per process)."""
    if not Path(python).exists():
        return EXL2Runtime(python, None, None, False, None, f"{python} does not exist")
    try:
        res = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        return EXL2Runtime(python, None, None, False, None, repr(exc))
    if res.returncode != 0 or not res.stdout.strip():
        return EXL2Runtime(python, None, None, False, None, res.stderr[-500:] or f"exit {res.returncode}")
    data = json.loads(res.stdout.strip().splitlines()[-1])
    return EXL2Runtime(python, data.get("exllamav2"), data.get("torch"), bool(data.get("cuda")), data.get("gpu"),
                       data.get("error"))


def runtime(settings: Settings) -> EXL2Runtime | None:
    """The ExLlamaV2 interpreter, probed: ``QUANTYARD_EXL2_PYTHON`` if set, else the managed ``exl2``
    environment when it has been built (``quantyard env ensure exl2`` on a CUDA machine); None otherwise."""
    from pipeline import envs

    try:
        python = envs.python_for("exl2", settings)
    except ToolchainMissingError:
        return None
    return probe(python)


def unavailable_reason(settings: Settings) -> str | None:
    """None when ExLlamaV2 can run here, else why not (for listings and errors)."""
    rt = runtime(settings)
    if rt is None:
        return ("no ExLlamaV2 interpreter: the managed exl2 environment is not built (`quantyard env ensure exl2` "
                "on a CUDA machine) and QUANTYARD_EXL2_PYTHON is not set")
    return rt.unavailable_reason


def require(settings: Settings) -> EXL2Runtime:
    """The ExLlamaV2 runtime, or ToolchainMissingError saying what is missing and what to do."""
    reason = unavailable_reason(settings)
    if reason is not None:
        raise ToolchainMissingError(
            f"ExLlamaV2 cannot run here: {reason}",
            hint="on a CUDA machine run `quantyard env ensure exl2` (or point QUANTYARD_EXL2_PYTHON at a Python "
                 "with exllamav2 0.3.2); without a GPU use --exl2-backend reference-cpu (or auto)")
    rt = runtime(settings)
    assert rt is not None
    return rt
