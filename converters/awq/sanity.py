"""AWQ folder sanity, without loading it into an engine: ``quantization_config`` complete for
compressed-tensors or legacy AutoAWQ checkpoints, and safetensors headers valid. Each problem raises
:class:`InvalidArtifactError` naming the file, what was expected and what was found.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

from converters.checkpoint import read_safetensors_header
from pipeline.errors import InvalidArtifactError, InvalidCheckpointError


def _fail(path: Path, message: str, hint: str = "re-create the checkpoint folder; it is damaged or not AWQ") \
        -> NoReturn:
    raise InvalidArtifactError(f"{path.name}: {message}", hint=hint)


def awq_sanity(folder: Path) -> dict[str, Any]:
    """Check an AWQ checkpoint folder's quantization_config and safetensors headers."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        _fail(cfg_path, "config.json is missing", hint="an AWQ variant is a checkpoint folder with config.json")
    cfg = json.loads(cfg_path.read_text())
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict):
        _fail(cfg_path, "quantization_config is missing", hint="re-export the AWQ checkpoint")
    method = qc.get("quant_method")
    required: tuple[str, ...]
    if method == "awq":
        required = ("bits", "group_size", "zero_point", "version")
    elif method == "compressed-tensors":
        required = ("format", "config_groups")
    else:
        _fail(cfg_path, f"quant_method is {method!r}, expected 'awq' or 'compressed-tensors'")
    missing = [k for k in required if k not in qc]
    if missing:
        _fail(cfg_path, f"quantization_config lacks {', '.join(missing)} (quant_method {method})",
              hint="re-export the checkpoint with its quantizer")
    if method == "compressed-tensors":
        for name, group in qc["config_groups"].items():
            w = (group or {}).get("weights") or {}
            gaps = [k for k in ("num_bits", "strategy") if k not in w]
            if gaps:
                _fail(cfg_path, f"config_groups.{name}.weights lacks {', '.join(gaps)}")
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        _fail(folder, "no *.safetensors files")
    tensors = 0
    for shard in shards:
        try:
            tensors += len(read_safetensors_header(shard))
        except InvalidCheckpointError as exc:
            raise InvalidArtifactError(exc.message, hint=exc.hint) from exc
    return {"quant_method": method, "shards": len(shards), "tensors": tensors}
