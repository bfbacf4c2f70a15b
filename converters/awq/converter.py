"""AWQ converter: 4/8-bit weight-only AWQ checkpoints for vLLM (and transformers).

* Backend ``llmcompressor`` (default): llm-compressor's ``AWQModifier`` then a weight-only
  ``QuantizationModifier`` (W4A16 asymmetric, group 128, ``lm_head`` kept), saved in
  compressed-tensors ``pack-quantized`` format. Runs in the ``awq`` tool environment.
* Backend ``autoawq``: AutoAWQ 0.2.9 in the ``autoawq`` environment, legacy GEMM layout
  (``quant_method: awq``, ``qweight``/``qzeros``/``scales``) for stacks that need it.

Calibration text (the bundled ``calibration.txt`` of the checkpoint, the built-in calibration
split, a file or a dataset) is tokenized here, once, with the source's own tokenizer, and cut
into ``calibration_samples`` samples of ``calibration_seq_len`` tokens; both backends get the
same ids. Its sha256 (text and ids) and the settings go into the lineage, together with the
tool environment's exact ``pip freeze``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from converters.awq.sanity import awq_sanity
from converters.base import BuildContext, BuiltVariant, Footprint, Prepared
from converters.checkpoint import Checkpoint
from pipeline import envs
from pipeline.config import Settings
from pipeline.cpu import cpu_compute_dtype, cpu_flags
from pipeline.errors import ConfigError, ConversionError, DiskFullError, InvalidSpecError, UnsupportedArchitectureError
from pipeline.footprint import DTYPE_BYTES, awq_calibration, quantized_bytes
from pipeline.fs import atomic_path
from pipeline.proc import child_env, failure_log_dir, run_logged
from pipeline.specs import AWQBackend, AWQSpec, QuantFormat, SourceRef
from pipeline.texts import calibration_text as pick_calibration_text
from pipeline.texts import text_sha256

WORKERS = {AWQBackend.LLMCOMPRESSOR: "converters.awq.workers.llmcompressor",
           AWQBackend.AUTOAWQ: "converters.awq.workers.autoawq"}
ENV_OF = {AWQBackend.LLMCOMPRESSOR: "awq", AWQBackend.AUTOAWQ: "autoawq"}
#: Pinned packages named in the tool identity (read from the environment's requirement file).
KEY_PACKAGES = {"awq": ("llmcompressor", "compressed-tensors", "transformers", "torch"),
                "autoawq": ("autoawq", "transformers", "torch")}


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            out[name.strip().lower().replace("_", "-")] = version.strip()
    return out


class AWQConverter:
    format: ClassVar[QuantFormat] = QuantFormat.AWQ

    def __init__(self, settings: Settings, backend: AWQBackend | None = None) -> None:
        self.settings = settings
        self.backend = backend

    # -- identity and checks ---------------------------------------------------------------------

    @staticmethod
    def describe(path: Path) -> tuple[str, dict[str, Any]]:
        """A plain AWQ folder's variant name and spec, from its quantization_config."""
        qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
        return "AWQ", {"bits": int(qc.get("bits", 4))}

    @staticmethod
    def read_structure(path: Path) -> None:
        """Raise InvalidArtifactError when ``path`` is not an AWQ checkpoint folder."""
        awq_sanity(path)

    @staticmethod
    def sanity(model: Path, files: list[Path]) -> tuple[str, dict[str, Any]]:
        """quantization_config and safetensors headers checked. Raises InvalidArtifactError."""
        summary = awq_sanity(model)
        return f"AWQ {summary['quant_method']}, {summary['tensors']} tensors", summary

    def env_identity(self, backend: AWQBackend) -> dict[str, Any]:
        """Which environment builds ``backend`` and its pinned versions, without building it."""
        name = ENV_OF[backend]
        own = envs.override_for(name, self.settings)
        if own:
            return {"env": name, "python": own}
        spec = envs.spec_for(name)
        build = spec.build_for(envs.detect_accelerator(self.settings))
        pins = _pins(build.requirements)
        return {"env": name, "env_key": envs.env_key(build),
                **{p: pins.get(p, "unpinned") for p in KEY_PACKAGES[name]}}

    def tool_identity(self) -> dict[str, Any]:
        """Tool identity of every backend (part of every AWQ build key)."""
        backends = [self.backend] if self.backend else list(AWQBackend)
        return {"name": "awq", **{b.value: self.env_identity(b) for b in backends}}

    def check(self, checkpoint: Checkpoint, specs: list[Any]) -> None:
        """Fail fast on what cannot be quantized: not a causal LM, AutoAWQ with 8 bits, a group size
        that does not divide every linear layer's input width, calibration samples longer than the model's
        context, a calibration file that changed."""
        if not checkpoint.architecture.endswith("ForCausalLM"):
            raise UnsupportedArchitectureError(
                f"AWQ here takes *ForCausalLM architectures (the model classes llm-compressor's and AutoAWQ's "
                f"layer mappings are written for), found {checkpoint.architecture}", supported=["*ForCausalLM"],
                hint="convert this checkpoint to GGUF, or pass a *ForCausalLM checkpoint")
        for spec in specs:
            if spec.backend == AWQBackend.AUTOAWQ and spec.bits != 4:
                raise InvalidSpecError(f"AutoAWQ writes 4-bit GEMM checkpoints only, {spec.bits} bits requested",
                                       hint="use --awq-backend llmcompressor for 8 bits")
            self._check_group_size(checkpoint, spec)
            self._check_seq_len(checkpoint, spec)
            if spec.calibration_sha256 and spec.calibration and not spec.calibration.startswith("dataset:"):
                path = Path(spec.calibration)
                found = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
                if found != spec.calibration_sha256:
                    raise ConfigError(f"calibration file {path} changed since the plan was made "
                                      f"(expected sha256 {spec.calibration_sha256[:12]}, found {found[:12]})",
                                      hint="run the command again to pin the current file")

    @staticmethod
    def _check_seq_len(checkpoint: Checkpoint, spec: AWQSpec) -> None:
        """Calibration samples must fit the context the model was made for (a GPT-2 stops on an index error
        inside the calibration pass; a RoPE model would be calibrated on activations it never produces)."""
        checkpoint.require_context(spec.calibration_seq_len, "AWQ calibration samples", "--awq-calibration-seq-len")

    @staticmethod
    def _check_group_size(checkpoint: Checkpoint, spec: AWQSpec) -> None:
        if spec.group_size == -1:
            return
        for name, t in checkpoint.tensors.items():
            if not name.endswith(".weight") or len(t.shape) != 2 or "lm_head" in name or "embed" in name:
                continue
            if int(t.shape[1]) % spec.group_size:
                raise InvalidSpecError(
                    f"AWQ group size {spec.group_size} does not divide the input width {t.shape[1]} of {name}",
                    hint="choose a group size that divides every linear layer's input width (e.g. 32, 64)")

    def footprint(self, checkpoint: Checkpoint, source: SourceRef, specs: list[Any]) -> Footprint:
        """ESTIMATES: calibration holds the whole model in its compute dtype (llm-compressor's sequential pipeline
        and AutoAWQ load it whole on the host, onloading layers to a GPU where there is one), plus the samples'
        activations; a variant is its linears at ``bits`` (+ a 16-bit scale and zero point per group), the
        embedding and head in the checkpoint's dtype."""
        facts = checkpoint.facts
        compute = self.compute_dtype(checkpoint) or checkpoint_dtype_name(checkpoint)
        own = 8 * DTYPE_BYTES.get(checkpoint_dtype_name(checkpoint), 2)
        needs = tuple(awq_calibration(facts, compute, s.calibration_samples, s.calibration_seq_len)
                      .at(f"build:{s.name}") for s in specs)
        sizes = {s.name: quantized_bytes(facts, s.bits + 32 / max(s.group_size, 32), own) for s in specs}
        return Footprint(needs=needs, variant_bytes=sizes)

    # -- build -----------------------------------------------------------------------------------

    def prepare(self, ctx: BuildContext, specs: list[Any]) -> Prepared:
        """Make sure the tool environments of the requested backends exist (built once, cached)."""
        prepared = Prepared()
        for backend in sorted({s.backend for s in specs}):
            info = envs.ensure(ENV_OF[backend], ctx.settings)
            prepared.paths[f"python:{backend.value}"] = info.python
            prepared.meta[f"env:{backend.value}"] = info.lineage()
            if info.created:
                prepared.events.append(f"env_build:{info.name}")
        return prepared

    def build_inputs(self, ctx: BuildContext, spec: AWQSpec) -> dict[str, Any]:
        """Inputs besides the spec that change the bytes (part of the build key): the compute dtype, when
        calibration does not run in the checkpoint's own."""
        compute = self.compute_dtype(ctx.checkpoint)
        return {"compute_dtype": compute} if compute else {}

    def compute_dtype(self, checkpoint: Checkpoint) -> str | None:
        """The dtype calibration runs in when it is not the checkpoint's own (None: its own). On CPU a
        bfloat16 checkpoint is calibrated in float32 unless the CPU has native bfloat16 (AVX-512 BF16, AMX):
        torch's bfloat16 matmuls are about 7× slower than float32 on an AVX2-only CPU. The output is saved
        in the checkpoint's dtype either way. Part of the build key (:meth:`build_inputs`)."""
        if envs.detect_accelerator(self.settings) == "cuda":
            return None
        own = checkpoint_dtype_name(checkpoint)
        chosen = cpu_compute_dtype(own)
        return None if chosen == own else chosen

    def build(self, ctx: BuildContext, prepared: Prepared, spec: AWQSpec, out_dir: Path) -> BuiltVariant:
        out_dir.mkdir(parents=True, exist_ok=True)
        calib, calib_meta = calibration_ids(ctx.checkpoint, spec)
        calib_path = out_dir / "calibration.npy"
        np.save(calib_path, calib)
        model_dir = out_dir / "model"
        _check_space(ctx.checkpoint, out_dir)
        result = self._run_worker(ctx, prepared, spec, calib_path, model_dir)
        info = inspect_awq(model_dir, spec)
        info["bpw"] = round(info["weights_bytes"] * 8 / max(1, ctx.checkpoint.n_params), 4)
        files = {p.name: p for p in sorted(model_dir.iterdir()) if p.is_file()}
        tool = {**self.env_identity(spec.backend), "name": "llm-compressor" if spec.backend ==
                AWQBackend.LLMCOMPRESSOR else "autoawq", "environment": prepared.meta[f"env:{spec.backend.value}"]}
        params = {"backend": spec.backend.value, "bits": spec.bits, "group_size": spec.group_size,
                  "symmetric": spec.symmetric, "calibration": calib_meta, "worker": result}
        return BuiltVariant(variant=spec.name, files=files, tool=tool, parameters=params, events=["quantize"],
                            info=info)

    def _run_worker(self, ctx: BuildContext, prepared: Prepared, spec: AWQSpec, calib: Path,
                    model_dir: Path) -> dict[str, Any]:
        result_path = model_dir.parent / "worker-result.json"
        with atomic_path(model_dir) as tmp:  # the worker writes the folder; removed if it fails
            request = {"model": str(ctx.checkpoint.path), "output": str(tmp), "calibration": str(calib),
                       "bits": spec.bits, "group_size": spec.group_size, "symmetric": spec.symmetric,
                       "threads": ctx.settings.threads, "seed": 0, "result": str(result_path),
                       "compute_dtype": self.compute_dtype(ctx.checkpoint), "cpu_flags": cpu_flags()}
            req_path = model_dir.parent / "worker-request.json"
            req_path.write_text(json.dumps(request, indent=1))
            python = prepared.paths[f"python:{spec.backend.value}"]
            res = run_logged([python, "-m", WORKERS[spec.backend], str(req_path)], log_dir=model_dir.parent,
                             name=f"awq-{spec.backend.value}", timeout_s=ctx.settings.convert_timeout_s,
                             env=child_env({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}),
                             keep=failure_log_dir(ctx.settings.logs_root))
            if not res.ok or not result_path.is_file():
                if res.disk_full:
                    raise DiskFullError(model_dir.parent)
                raise ConversionError(f"AWQ quantization with {spec.backend.value} {res.describe()}",
                                      stderr_tail=res.stderr_tail, hint=f"see the log {res.log}")
        return dict(json.loads(result_path.read_text()))


def checkpoint_dtype_name(checkpoint: Checkpoint) -> str:
    """``float32``, ``bfloat16`` or ``float16``: the dtype the checkpoint's config declares."""
    for name in ("bfloat16", "float16", "float32"):
        if name in checkpoint.torch_dtype:
            return name
    return "float32"


# --- calibration ---------------------------------------------------------------------------------


def calibration_text(spec: AWQSpec, checkpoint: Path) -> tuple[str, str]:
    """The calibration text and where it came from (pipeline.texts): ``spec.calibration`` (a file or
    ``dataset:…``), else the bundled calibration text, which never overlaps the evaluation text."""
    return pick_calibration_text(checkpoint, spec.calibration)


def calibration_ids(checkpoint: Checkpoint, spec: AWQSpec) -> tuple[np.ndarray, dict[str, Any]]:
    """Token ids [n, seq_len] for calibration: the text tokenized once with the source's tokenizer,
    cut into consecutive chunks (BOS first when the tokenizer adds one), ``n`` of them spread evenly
    over the text.

    Raises:
        InvalidSpecError: the text is shorter than one sample.
    """
    from transformers import AutoTokenizer

    text, origin = calibration_text(spec, checkpoint.path)
    tok = AutoTokenizer.from_pretrained(str(checkpoint.path), trust_remote_code=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    probe = tok("a", add_special_tokens=True)["input_ids"]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None and probe and probe[0] == tok.bos_token_id else []
    body = spec.calibration_seq_len - len(bos)
    n_chunks = len(ids) // body
    if n_chunks < 1:
        raise InvalidSpecError(f"the calibration text has {len(ids)} tokens, fewer than one sample of "
                               f"{spec.calibration_seq_len}", hint="use a longer text or a smaller sequence length")
    n = min(spec.calibration_samples, n_chunks)
    pick = np.unique(np.linspace(0, n_chunks - 1, n).round().astype(int))
    arr = np.asarray([bos + ids[i * body:(i + 1) * body] for i in pick], dtype=np.int32)
    meta = {"origin": origin, "text_sha256": text_sha256(text),
            "ids_sha256": hashlib.sha256(arr.tobytes()).hexdigest(), "samples": int(arr.shape[0]),
            "samples_requested": spec.calibration_samples, "seq_len": int(arr.shape[1]), "text_tokens": len(ids)}
    return arr, meta


# --- output checks -------------------------------------------------------------------------------


def safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return dict(json.loads(fh.read(n)))


def inspect_awq(folder: Path, spec: AWQSpec) -> dict[str, Any]:
    """Check an AWQ output folder against its spec; returns a summary.

    Raises:
        ConversionError: missing config or weights, wrong quantization method/format/bits, or
        quantized tensors missing.
    """
    cfg_path = folder / "config.json"
    weights = sorted(folder.glob("*.safetensors"))
    if not cfg_path.is_file() or not weights:
        raise ConversionError(f"AWQ output {folder} has no config.json or no safetensors file")
    qc = json.loads(cfg_path.read_text()).get("quantization_config") or {}
    names: set[str] = set()
    for w in weights:
        names |= {k for k in safetensors_header(w) if k != "__metadata__"}
    if spec.backend == AWQBackend.LLMCOMPRESSOR:
        problems = _check_compressed_tensors(qc, names, spec)
        fmt = qc.get("format")
    else:
        problems = _check_gemm(qc, names, spec)
        fmt = str(qc.get("version"))
    if problems:
        raise ConversionError(f"AWQ output failed its check: {'; '.join(problems)}",
                              hint="the quantizer wrote an unexpected layout; report it with the logs")
    return {"quant_method": qc.get("quant_method"), "format": fmt, "tensor_count": len(names),
            "quantized_layers": sum(1 for n in names if n.endswith((".weight_packed", ".qweight"))),
            "weights_bytes": sum(w.stat().st_size for w in weights)}


def _check_compressed_tensors(qc: dict[str, Any], names: set[str], spec: AWQSpec) -> list[str]:
    problems = []
    if qc.get("quant_method") != "compressed-tensors":
        problems.append(f"quant_method {qc.get('quant_method')!r} (expected 'compressed-tensors')")
    if qc.get("format") != "pack-quantized":
        problems.append(f"format {qc.get('format')!r} (expected 'pack-quantized')")
    groups = list((qc.get("config_groups") or {}).values())
    w = (groups[0].get("weights") or {}) if groups else {}
    expected = {"num_bits": spec.bits, "symmetric": spec.symmetric,
                "group_size": None if spec.group_size == -1 else spec.group_size}
    problems += [f"weights.{k} = {w.get(k)!r} (expected {v!r})" for k, v in expected.items() if w.get(k) != v]
    packed = [n for n in names if n.endswith(".weight_packed")]
    if not packed:
        problems.append("no weight_packed tensors")
    if any(n.startswith("lm_head.") and n != "lm_head.weight" for n in names):
        problems.append("lm_head was quantized (it must be kept)")
    if not spec.symmetric and not all(n.replace("weight_packed", "weight_zero_point") in names for n in packed):
        problems.append("asymmetric quantization without weight_zero_point tensors")
    return problems


def _check_gemm(qc: dict[str, Any], names: set[str], spec: AWQSpec) -> list[str]:
    problems = []
    if qc.get("quant_method") != "awq":
        problems.append(f"quant_method {qc.get('quant_method')!r} (expected 'awq')")
    if str(qc.get("version", "")).lower() != "gemm":
        problems.append(f"version {qc.get('version')!r} (expected 'gemm')")
    if qc.get("bits") != spec.bits or qc.get("group_size") != spec.group_size:
        problems.append(f"bits/group_size {qc.get('bits')}/{qc.get('group_size')} "
                        f"(expected {spec.bits}/{spec.group_size})")
    if bool(qc.get("zero_point")) == spec.symmetric:
        problems.append(f"zero_point {qc.get('zero_point')!r} for symmetric={spec.symmetric}")
    qweights = [n for n in names if n.endswith(".qweight")]
    if not qweights or not all(n.replace("qweight", s) in names for n in qweights for s in ("qzeros", "scales")):
        problems.append("qweight/qzeros/scales tensors missing")
    return problems


def _check_space(checkpoint: Checkpoint, where: Path) -> None:
    need = checkpoint.size_bytes + (64 << 20)
    free = shutil.disk_usage(where).free
    if need > free:
        raise DiskFullError(where, needed=need, free=free)


__all__ = ["AWQConverter", "calibration_ids", "inspect_awq"]
