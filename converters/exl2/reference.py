"""The reference-cpu EXL2 backend at model level: calibration, measurement, allocation, writing.

Runs inside ``converters.exl2.workers.reference`` (a subprocess of the core interpreter), never in
the orchestrating process. Two steps, mirroring exllamav2's "measure once, quantize per bpw":

* :func:`measure`: tokenize the calibration text into rows × length, run the unquantized model
  once collecting every linear layer's input Hessian ``XᵀX``, quantize every decoder layer at every
  candidate layout (``converters.exl2.quantizer.OPTIONS``) and record exact bits and relative error.
  Writes ``measurement.json`` and ``hessians.safetensors``.
* :func:`quantize`: for each requested bpw, allocate bits from the measurement, GPTQ every decoder
  layer at its layout and the head at ``head_bits``, and write an exllamav2-style folder: ``output.safetensors``
  (quantized linears, everything else fp16), the source's non-weight files, and ``config.json`` with
  ``quantization_config.quant_method = "exl2"``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from converters.exl2.converter import CODEC_VERSION
from converters.exl2.quantizer import OPTIONS, Candidates, allocate, gptq, head_option, measure_layer
from pipeline.errors import InvalidSpecError
from pipeline.exl2_codec import encode, storage_bits

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """GPTQ runs thousands of small row operations: one thread is several times faster than two on a
    busy machine (no synchronisation between threads per operation)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- model and calibration -----------------------------------------------------------------------


def load_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=False)
    return model.eval()


def calibration_ids(tokenizer_dir: Path, text: str, rows: int, length: int, max_ctx: int | None
                    ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Calibration rows: the text tokenized once and cut into at most ``rows`` rows of ``length`` ids
    (fewer rows, or shorter rows, when the text is short). Returns ids and what was used."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    length = min(length, max_ctx or length, len(ids))
    if length < 16:
        raise InvalidSpecError(f"the calibration text has {len(ids)} tokens: too few to calibrate EXL2",
                               hint="give a longer calibration text (thousands of tokens)")
    n_rows = max(1, min(rows, len(ids) // length))
    used = torch.tensor(ids[: n_rows * length], dtype=torch.int64).view(n_rows, length)
    info = {"rows": n_rows, "length": length, "requested_rows": rows, "text_tokens": len(ids),
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "ids_sha256": hashlib.sha256(used.numpy().astype("<i8").tobytes()).hexdigest()}
    return used, info


def quantizable_linears(model: Any) -> tuple[dict[str, torch.nn.Linear], str | None]:
    """Decoder linear layers by name, and the output head's name (None when tied to the embedding)."""
    head = model.get_output_embeddings()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    layers, head_name = {}, None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if module is head:
            head_name = None if tied else name
        else:
            layers[name] = module
    return layers, head_name


def collect_hessians(model: Any, names: dict[str, torch.nn.Linear], ids: torch.Tensor, batch: int = 1
                     ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``XᵀX / tokens`` of each layer's inputs over the calibration rows, computed once per distinct
    input: a layer called with the very tensor the previous layer got (q/k/v, gate/up) shares its
    Hessian. Returns ({owner: H}, {layer: owner})."""
    sums: dict[str, torch.Tensor] = {}
    owner: dict[str, str] = {}
    last: list[Any] = [None, None]  # (input tensor, layer); holding it keeps its identity unique

    def hook(name: str) -> Any:
        def fn(_module: Any, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0]
            if last[0] is x:
                owner.setdefault(name, owner[last[1]])
                if owner[name] != name:
                    return
            last[0], last[1] = x, name
            owner.setdefault(name, name)
            if owner[name] != name:  # shared in an earlier batch, so shared again: already counted
                return
            flat = x.detach().reshape(-1, x.shape[-1]).float()
            h = sums.setdefault(name, torch.zeros((flat.shape[1], flat.shape[1]), dtype=torch.float64))
            h += flat.t() @ flat

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in names.items()]
    try:
        with torch.inference_mode():
            for b in range(0, ids.shape[0], batch):
                model(input_ids=ids[b:b + batch])
                last[0] = last[1] = None
    finally:
        for h in handles:
            h.remove()
    n_tokens = ids.numel()
    return {k: (v / n_tokens).float() for k, v in sums.items()}, owner


# --- measurement ---------------------------------------------------------------------------------


def measure(model_dir: Path, text: str, origin: str, out_dir: Path, rows: int, length: int) -> dict[str, Any]:
    """Write ``measurement.json`` and ``hessians.safetensors`` for a checkpoint into ``out_dir``."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    model = load_model(model_dir)
    linears, head = quantizable_linears(model)
    max_ctx = getattr(model.config, "max_position_embeddings", None)
    ids, calib = calibration_ids(model_dir, text, rows, length, max_ctx)
    everything = {**linears, **({head: model.get_output_embeddings()} if head else {})}
    hessians, owner = collect_hessians(model, everything, ids)
    layers = {}
    with torch_threads(1):
        for name, mod in linears.items():
            layers[name] = {"shape": list(mod.weight.shape), "bias": mod.bias is not None, "hessian": owner[name],
                            "options": measure_layer(mod.weight.data, hessians[owner[name]], mod.bias is not None)}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hessians.items()}, str(out_dir / "hessians.safetensors"))
    doc = {"format": "quantyard-exl2-measurement", "backend": "reference-cpu", "codec_version": CODEC_VERSION,
           "calibration": {**calib, "origin": origin}, "head": head,
           "head_hessian": owner.get(head) if head else None,
           "options": [o.name for o in OPTIONS], "layers": layers,
           "measure_s": round(time.perf_counter() - t0, 3)}
    (out_dir / "measurement.json").write_text(json.dumps(doc, indent=1))
    return doc


def candidates(measurement: dict[str, Any]) -> list[Candidates]:
    out = []
    for name, layer in measurement["layers"].items():
        opts = sorted(layer["options"], key=lambda o: o["option"])
        out.append(Candidates(name=name, numel=layer["shape"][0] * layer["shape"][1],
                              bits=tuple(int(o["bits"]) for o in opts), errors=tuple(float(o["error"]) for o in opts)))
    return out


# --- quantization and writing --------------------------------------------------------------------


def quantize(model_dir: Path, measurement_dir: Path, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Write one EXL2 folder per job ``{"out", "bpw", "head_bits"}``: decoder layers at the job's bpw,
    the head at its head bits. The model and the Hessians are loaded once for all jobs."""
    from safetensors.torch import load_file

    meas = json.loads((measurement_dir / "measurement.json").read_text())
    hessians = load_file(str(measurement_dir / "hessians.safetensors"))
    model = load_model(model_dir)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return [_quantize_one(model_dir, meas, hessians, dict(state), tied, Path(job["out"]), float(job["bpw"]),
                          int(job["head_bits"])) for job in jobs]


def _quantize_one(model_dir: Path, meas: dict[str, Any], hessians: dict[str, torch.Tensor],
                  state: dict[str, torch.Tensor], tied: bool, out_dir: Path, bpw: float, head_bits: int
                  ) -> dict[str, Any]:
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    choice, achieved = allocate(candidates(meas), bpw)
    layouts = {name: OPTIONS[i] for name, i in choice.items()}
    if meas["head"]:
        layouts[meas["head"]] = head_option(head_bits)
    hessian_of = {n: meas["layers"][n]["hessian"] for n in choice} | (
        {meas["head"]: meas["head_hessian"]} if meas["head"] else {})
    tensors: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    with torch_threads(1):
        for name, opt in layouts.items():
            weight, bias = state.pop(f"{name}.weight"), state.pop(f"{name}.bias", None)
            res = gptq(weight, hessians[hessian_of[name]], opt.groups(weight.shape[1]), bias)
            errors[name] = res.error
            tensors.update({f"{name}.{k}": v for k, v in encode(res.layer).items()})
    for key, value in state.items():
        if tied and meas["head"] is None and key.endswith("lm_head.weight"):
            continue  # a tied head is the embedding; exllamav2 and transformers re-tie it
        tensors[key] = value.to(torch.float16).contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "output.safetensors"), metadata={"format": "pt"})
    _copy_non_weights(model_dir, out_dir)
    _write_config(model_dir, out_dir, bpw, head_bits, meas["calibration"])
    shapes = {n: meas["layers"][n] for n in choice}
    decoder_bits = sum(storage_bits(layouts[n].groups(v["shape"][1]), v["shape"][1], v["shape"][0], v["bias"])
                       for n, v in shapes.items())
    decoder_numel = sum(v["shape"][0] * v["shape"][1] for v in shapes.values())
    return {"target_bpw": bpw, "head_bits": head_bits, "decoder_bpw": decoder_bits / decoder_numel,
            "allocated_bpw": achieved, "allocation": {n: OPTIONS[i].name for n, i in choice.items()},
            "layer_error": errors, "head": meas["head"], "quantize_s": round(time.perf_counter() - t0, 3)}


def _copy_non_weights(src: Path, dest: Path) -> None:
    for path in sorted(src.iterdir()):
        if not path.is_file() or path.suffix in WEIGHT_SUFFIXES or path.name in WEIGHT_INDEXES:
            continue
        shutil.copyfile(path, dest / path.name)


def _write_config(src: Path, dest: Path, bpw: float, head_bits: int, calibration: dict[str, Any]) -> None:
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "exl2", "version": f"quantyard-reference-cpu-{CODEC_VERSION}", "backend": "reference-cpu",
        "bits": bpw, "head_bits": head_bits,
        "calibration": {"rows": calibration["rows"], "length": calibration["length"],
                        "dataset": calibration.get("origin"), "sha256": calibration["text_sha256"]}}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
