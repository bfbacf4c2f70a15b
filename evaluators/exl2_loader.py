"""Load an EXL2 folder into a transformers model by dequantizing every EXL2 layer with Quantyard's
reference codec (``pipeline.exl2_codec``, which imports only torch), for CPU evaluation.

The model computes with the fp16 weights the codec reconstructs, designed to be bit for bit what the
ExLlamaV2 kernels reconstruct (the GPU comparison's status: pipeline/status.py),
upcast to ``dtype``; everything else (embeddings, norms) is taken from the file as stored. This
measures the *quantization*, not ExLlamaV2's speed or its fp16 arithmetic: results are labelled
engine ``exl2-reference``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.exl2_codec import dequantize, layer_prefixes, split_layer


def read_tensors(folder: Path) -> dict[str, Any]:
    """Every tensor of an EXL2 folder (``output.safetensors`` or ``output-0000N-of-0000M``)."""
    from safetensors.torch import load_file

    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file() or p.is_symlink())
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {folder}")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(str(f.resolve())))
    return tensors


def dequantized_state(folder: Path, dtype: Any, widths: dict[str, int] | None = None) -> dict[str, Any]:
    """A transformers state dict: each EXL2 layer ``x`` becomes ``x.weight`` (and ``x.bias``).

    EXL2 stores a layer's output columns padded to a multiple of 32 and not its width; a biased layer's bias
    gives it, an unbiased one's comes from ``widths`` (``x.weight`` → output features, the model's own), else
    the padded width is kept. An output head over a vocabulary of 4100 is 4128 columns wide on disk."""
    tensors = read_tensors(folder)
    state: dict[str, Any] = {}
    quantized = layer_prefixes(list(tensors))
    for prefix in quantized:
        layer = split_layer(tensors, prefix)
        state[f"{prefix}.weight"] = dequantize(layer, (widths or {}).get(f"{prefix}.weight")).to(dtype)
        if "bias" in layer:
            state[f"{prefix}.bias"] = layer["bias"].to(dtype)
    owned = {f"{p}.{s}" for p in quantized for s in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm",
                                                       "q_perm", "bias")}
    for name, value in tensors.items():
        if name not in owned:
            state[name] = value.to(dtype) if value.is_floating_point() else value
    return state


def _config(folder: Path) -> Any:
    from transformers import AutoConfig

    raw = json.loads((folder / "config.json").read_text())
    qcfg = raw.get("quantization_config") or {}
    if qcfg.get("quant_method") != "exl2":
        raise ValueError(f"{folder}/config.json has quant_method {qcfg.get('quant_method')!r}, expected 'exl2'")
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # transformers has no EXL2 quantizer; the weights arrive dequantized
    return config


def load_exl2_as_hf(path: Path, dtype: Any = None, device: str = "cpu") -> Any:
    """A transformers causal LM holding the dequantized weights of the EXL2 folder ``path``.

    Raises FileNotFoundError / ValueError (runner side: the orchestrator turns a failed runner into
    an EngineError with this message) when the folder is not an EXL2 model.
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    config = _config(path)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers (the tool environments'); mypy sees the newer one in .venv
        from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined, no-redef]
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    widths = {name: int(p.shape[0]) for name, p in model.state_dict().items() if p.dim() == 2}
    state = dequantized_state(path, dtype, widths)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"EXL2 folder {path} does not fit {config.architectures}: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    if tied:
        model.tie_weights()
    return model.to(device).eval()
