"""AWQ with llm-compressor, run in the ``awq`` tool environment.

``python -m converters.awq.workers.llmcompressor REQUEST.json`` where the request holds
``model`` (source folder), ``output`` (folder to create), ``calibration`` (npy of int token ids
[n_samples, seq_len], tokenized by Quantyard with the source's tokenizer), ``bits``,
``group_size``, ``symmetric``, ``threads``, ``seed`` and ``result`` (where to write the result
JSON). The recipe is ``AWQModifier(duo_scaling="both")`` followed by a weight-only
``QuantizationModifier`` on every ``Linear`` except ``lm_head``; the model is saved in
compressed-tensors ``pack-quantized`` format.

``python -m converters.awq.workers.llmcompressor --patch-check`` reports whether the CPU
``pin_memory`` patch below is still needed and still applies (tests/converters/test_awq.py
fails when either stops being true).

Imports only the standard library, numpy and the tool's own stack.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from converters.worker_protocol import read_request, write_result

#: The error llm-compressor 0.14 raises on a machine without an accelerator (TOOLCHAINS.md).
PIN_ERROR = "Cannot access accelerator device when none is available"


def _pin_memory_needed() -> tuple[bool, str]:
    """Call the unpatched ``IntermediatesCache.pin_memory`` on a CPU tensor: does it fail here?"""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache, IntermediateValue

    cache = IntermediatesCache([{"x": IntermediateValue(value=torch.zeros(2), device=None)}])
    try:
        cache.pin_memory(0)
    except RuntimeError as exc:
        return PIN_ERROR in str(exc), str(exc)
    return False, "pin_memory works here"


def apply_cpu_pin_memory_patch() -> str:
    """Make ``IntermediatesCache.pin_memory`` a no-op when no accelerator is available.

    llm-compressor pins cached activations to speed host-to-device copies; with no device,
    ``Tensor.pin_memory()`` raises. Pinning is only an optimisation, so skipping it changes no
    number. Returns what was done; raises RuntimeError if the patch target has moved.
    """
    import torch

    if torch.accelerator.is_available():
        return "not applied (accelerator present)"
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not callable(getattr(IntermediatesCache, "pin_memory", None)):
        raise RuntimeError("llmcompressor.pipelines.cache.IntermediatesCache.pin_memory no longer exists: "
                           "the CPU patch no longer applies; re-check TOOLCHAINS.md for this version")

    def _no_pin(self: Any, batch_index: int, input_names: list[str] | None = None) -> None:
        del self, batch_index, input_names

    IntermediatesCache.pin_memory = _no_pin
    return "applied (no accelerator: pin_memory is a no-op)"


def patch_check() -> dict[str, Any]:
    """Whether the patch is needed (the unpatched call fails) and applies (the patched call works)."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache, IntermediateValue

    needed, detail = _pin_memory_needed()
    status = apply_cpu_pin_memory_patch()
    cache = IntermediatesCache([{"x": IntermediateValue(value=torch.zeros(2), device=None)}])
    try:
        cache.pin_memory(0)
        works = True
    except RuntimeError as exc:
        works, detail = False, f"{detail}; after patch: {exc}"
    return {"needed": needed, "applies": status.startswith("applied") and works, "status": status,
            "detail": detail, "accelerator": bool(torch.accelerator.is_available())}


def mappings_used(architecture: str) -> str:
    """Which layer mappings llm-compressor takes for ``architecture``: its own, or its default."""
    from llmcompressor.modifiers.transform.awq.mappings import AWQ_MAPPING_REGISTRY

    return (f"llm-compressor's for {architecture}" if architecture in AWQ_MAPPING_REGISTRY else
            "llm-compressor's default (written for Llama's layer names)")


def _unfit(architecture: str, mappings: str, exc: ValueError) -> RuntimeError:
    return RuntimeError(f"AWQ cannot calibrate {architecture}: {mappings} name layers this model does not have; "
                        f"convert it to GGUF instead (llm-compressor: {' '.join(str(exc).split())})")


def _unmatched(architecture: str, mappings: str) -> RuntimeError:
    return RuntimeError(f"AWQ cannot calibrate {architecture}: {mappings} match none of its layers, so nothing "
                        "would be smoothed and plain round-to-nearest weights would be registered as AWQ; convert "
                        "it to GGUF instead")


def precheck_mappings(model_dir: str) -> dict[str, Any]:
    """Match llm-compressor's layer mappings against the model built on the meta device, before any weight is
    read: a model they do not fit fails in seconds instead of after loading (minutes and its size in RAM at
    70 B). The match is llm-compressor's own (``get_layer_mappings_from_model``, ``match_modules_set``) on the
    module names transformers builds, which its offset-norm replacement keeps; a mixture of experts is not
    checked here (llm-compressor rewrites its experts into linears before matching), only by
    :func:`record_mappings` during calibration. Returns what it found; raises RuntimeError as that does."""
    import torch
    from compressed_tensors.utils import match_modules_set
    from llmcompressor.modifiers.transform.awq import get_layer_mappings_from_model
    from llmcompressor.modifiers.utils.pytorch_helpers import is_moe_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    architecture = type(model).__name__
    if is_moe_model(model):
        return {"checked": False, "why": "mixture of experts: matched during calibration"}
    mappings = mappings_used(architecture)
    names = {id(module): name for name, module in model.named_modules()}
    matched = 0
    for mapping in get_layer_mappings_from_model(model):
        try:
            groups = list(match_modules_set(model, (mapping.smooth_layer, *mapping.balance_layers)))
        except ValueError as exc:
            raise _unfit(architecture, mappings, exc) from exc
        matched += len(groups)
        for smooth in (module for group in groups for module in group[0]):
            # its AWQ divides the smoothing layer's weight by the scales it finds (llm-compressor 0.11's mapping
            # for BLOOM smooths from the GELU, which has none, and stops on AttributeError after calibration)
            if not isinstance(getattr(smooth, "weight", None), torch.Tensor):
                raise RuntimeError(
                    f"AWQ cannot calibrate {architecture}: {mappings} smooth from {names[id(smooth)]} "
                    f"({type(smooth).__name__}), which has no weight for llm-compressor's AWQ to scale; convert it "
                    "to GGUF instead")
    if not matched:
        raise _unmatched(architecture, mappings)
    return {"checked": True, "matched": matched}


def record_mappings(modifier_cls: Any, architecture: str) -> dict[str, Any]:
    """Wrap ``modifier_cls._set_resolved_mappings`` (where AWQModifier matches its layer mappings to the model's
    modules) so that what it resolved is recorded, and so that a mapping that does not fit the model fails with a
    message that says so. Returns the dict it fills: ``mappings`` (llm-compressor's own for the architecture, or
    its default written for Llama's layer names), ``smoothed`` (smoothing layers matched) and ``balanced``
    (linear layers scaled against them). Raises RuntimeError if the target has moved."""
    original = getattr(modifier_cls, "_set_resolved_mappings", None)
    if not callable(original):
        raise RuntimeError("AWQModifier._set_resolved_mappings no longer exists: the mapping record no longer "
                           "applies; re-check it for this llm-compressor version")
    record: dict[str, Any] = {"mappings": mappings_used(architecture)}

    def resolve(self: Any, model: Any) -> None:
        try:
            original(self, model)
        except ValueError as exc:
            raise _unfit(architecture, record["mappings"], exc) from exc
        resolved = list(self._resolved_mappings)
        record["smoothed"] = len(resolved)
        record["balanced"] = sum(len(m.balance_layers) for m in resolved)
        if not resolved:
            raise _unmatched(architecture, record["mappings"])

    modifier_cls._set_resolved_mappings = resolve
    return record


def _scheme(req: dict[str, Any]) -> dict[str, Any]:
    """QuantizationModifier arguments: the W4A16_ASYM preset for the default settings, else an
    explicit weight-only config group with the requested bits, group size and symmetry."""
    bits, gs, sym = int(req["bits"]), int(req["group_size"]), bool(req["symmetric"])
    common = {"targets": ["Linear"], "ignore": ["lm_head"]}
    if (bits, gs, sym) == (4, 128, False):
        return {**common, "scheme": "W4A16_ASYM"}
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "channel" if gs == -1 else "group", **({} if gs == -1 else {"group_size": gs})}
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": ["lm_head"]}


def quantize(req: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(int(req["threads"]))
    torch.manual_seed(int(req.get("seed", 0)))
    patch = apply_cpu_pin_memory_patch()
    ids = np.load(req["calibration"]).astype(np.int64)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()})
    compute = req.get("compute_dtype")  # None: the checkpoint's own dtype
    precheck = precheck_mappings(req["model"])  # before the weights load
    model = AutoModelForCausalLM.from_pretrained(req["model"], dtype=compute or "auto", trust_remote_code=False)
    saved = _declared_dtype(req["model"])
    tokenizer = AutoTokenizer.from_pretrained(req["model"], trust_remote_code=False)
    scheme = _scheme(req)
    mappings = record_mappings(AWQModifier, type(model).__name__)
    recipe = [AWQModifier(duo_scaling="both"), QuantizationModifier(**scheme)]
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=int(ids.shape[1]),
            num_calibration_samples=int(ids.shape[0]))
    quant_s = time.perf_counter() - t0
    if compute and saved and compute != saved:
        # Calibrated in float32 for speed on this CPU; the checkpoint keeps its own dtype (scales, and the
        # unquantized embeddings, norms and lm_head), as a calibration in that dtype would have written it.
        model.to(getattr(torch, saved))
    out = Path(req["output"])
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    return {"quantize_s": quant_s, "patch": patch, "scheme": scheme, "awq_mappings": mappings,
            "awq_mappings_precheck": precheck,
            "n_samples": int(ids.shape[0]),
            "seq_len": int(ids.shape[1]), "torch": torch.__version__, "compute_dtype": compute or saved,
            "saved_dtype": saved, "cpu_flags": req.get("cpu_flags")}


def _declared_dtype(model_dir: str) -> str | None:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    return str(value) if value else None


def main() -> int:
    if sys.argv[1:] == ["--patch-check"]:
        print(json.dumps(patch_check()))
        return 0
    req = read_request("converters.awq.workers.llmcompressor", " | --patch-check")
    write_result(req["result"], quantize(req))
    return 0


if __name__ == "__main__":
    sys.exit(main())
