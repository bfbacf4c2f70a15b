"""EXL2 converter with two backends, named in every spec, lineage and variant name.

* ``exllamav2`` (CUDA only): exllamav2's own ``convert_exl2`` in its interpreter
  (``QUANTYARD_EXL2_PYTHON``). The measurement pass runs once per (source, calibration) with
  ``-om measurement.json``, which is registered as an artifact of the source; each bpw is then
  ``-m measurement.json -b BPW -hb HEAD``. Every job runs in a work folder that persists, so an
  interrupted conversion resumes from its ``job_new.json``.
* ``reference-cpu``: Quantyard's reference codec (``converters/exl2/quantizer.py``,
  ``converters/exl2/reference.py``, ``pipeline/exl2_codec.py``) in a worker subprocess of the core
  interpreter: the same "measure once, quantize per bpw" shape, the same file layout, but GPTQ with a
  greedy allocation instead of exllamav2's optimizer (see ``converters/exl2/quantizer.py``).

A spec without a backend gets ``exllamav2`` where it can run, else ``reference-cpu``
(:meth:`EXL2Converter.resolve_spec`, applied by the flow before build keys are computed).
Calibration text comes from the flow (``flows/steps.calibration_text``); rows, length, token counts
and the text's sha256 go into the lineage.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

from converters.base import BuildContext, BuiltVariant, Calibration, Footprint, Prepared
from converters.checkpoint import Checkpoint, read_safetensors_header
from pipeline import exl2_env, workdir
from pipeline.config import Settings
from pipeline.errors import ConfigError, ConversionError, DiskFullError, UnsupportedArchitectureError
from pipeline.footprint import TORCH_PROCESS, Need, quantized_bytes
from pipeline.proc import ProcResult, child_env, failure_log_dir, run_logged
from pipeline.specs import EXL2Backend, EXL2Spec, QuantFormat, SourceRef

REFERENCE_WORKER = "converters.exl2.workers.reference"
PARQUET_WORKER = "converters.exl2.workers.parquet"
CONVERT_MODULE = "exllamav2.conversion.convert_exl2"
CODEC_VERSION = "1"  # reference-cpu: bump whenever the bytes it writes change
MEASUREMENT_KIND = "exl2_measurement"


#: The text architectures ExLlamaV2 0.3.2 (the pinned version) loads by name (``exllamav2/architecture.py``,
#: its ``arch_string`` branches). It loads any other name as a Llama after printing a warning, so an EXL2 of
#: another architecture would be a file no engine reads correctly: refused here for both backends.
EXLLAMAV2_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "YiForCausalLM", "OrionForCausalLM",
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
    "Starcoder2ForCausalLM", "GemmoeForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "DbrxForCausalLM",
    "Phi3ForCausalLM", "GPTBigCodeForCausalLM", "GPT2LMHeadModel", "MiniCPMForCausalLM", "InternLM2ForCausalLM",
    "IndexForCausalLM", "GraniteForCausalLM", "Glm4ForCausalLM",
})

@dataclass(frozen=True)
class CalibrationSize:
    """Calibration rows × tokens per row (capped by the text's length at run time)."""

    rows: int
    length: int
    measurement_rows: int
    measurement_length: int


#: exllamav2's own defaults (convert_exl2 -r/-l/-mr/-ml).
EXLLAMAV2_CALIBRATION = CalibrationSize(rows=100, length=2048, measurement_rows=16, measurement_length=2048)
#: The reference backend uses one set for measuring and quantizing: 16k tokens in rows of 512 bound
#: the CPU cost of the forward pass while giving every Hessian far more samples than dimensions.
REFERENCE_CALIBRATION = CalibrationSize(rows=32, length=512, measurement_rows=32, measurement_length=512)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


class EXL2Converter:
    format: ClassVar[QuantFormat] = QuantFormat.EXL2

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @property
    def _keep(self) -> Path:
        return failure_log_dir(self.settings.logs_root)

    # -- backends and identity -------------------------------------------------------------------

    @staticmethod
    def describe(path: Path) -> tuple[str, dict[str, Any]]:
        """A plain EXL2 folder's variant name and spec, from its quantization_config (bits per weight)."""
        qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
        bpw = float(qc.get("bits", 4.0))
        return f"EXL2-{bpw:g}bpw", {"bpw": bpw}

    @staticmethod
    def sanity(model: Path, files: list[Path]) -> tuple[str, dict[str, Any]]:
        """Every layer's groups against its tensor shapes (:func:`inspect_exl2`). Raises ConversionError."""
        summary = inspect_exl2(model)
        return (f"EXL2 {summary['quantized_layers']} quantized layers, {summary['tensor_count']} tensors, "
                f"decoder {summary['decoder_bpw']:.3f} bpw"), summary

    def resolve_spec(self, spec: EXL2Spec) -> EXL2Spec:
        """Fill in the backend: exllamav2 where it can run, else reference-cpu."""
        if spec.backend is not None:
            return spec
        backend = EXL2Backend.EXLLAMAV2 if exl2_env.unavailable_reason(self.settings) is None \
            else EXL2Backend.REFERENCE_CPU
        return spec.model_copy(update={"backend": backend})

    def tool_identity_for(self, spec: EXL2Spec) -> dict[str, Any]:
        """Exact tool versions of the backend that builds ``spec`` (part of its build key)."""
        if self.resolve_spec(spec).backend == EXL2Backend.EXLLAMAV2:
            rt = exl2_env.require(self.settings)
            return {"name": "exllamav2", "backend": EXL2Backend.EXLLAMAV2.value, "exllamav2": rt.exllamav2,
                    "torch": rt.torch, "calibration": asdict(EXLLAMAV2_CALIBRATION)}
        return {"name": "quantyard-exl2-reference", "backend": EXL2Backend.REFERENCE_CPU.value,
                "codec_version": CODEC_VERSION, "torch": _version("torch"), "transformers": _version("transformers"),
                "calibration": asdict(REFERENCE_CALIBRATION)}

    def tool_identity(self) -> dict[str, Any]:
        """The identity of the backend an unspecified EXL2 variant would use here."""
        return self.tool_identity_for(EXL2Spec(bpw=4.0))

    # -- checks ----------------------------------------------------------------------------------

    def check(self, checkpoint: Checkpoint, specs: list[Any]) -> None:
        """Fail fast: an architecture ExLlamaV2 loads, linear input widths that are multiples of 32, a usable
        backend, and for the reference codec a model whose every weight matrix it can write as EXL2."""
        arch = checkpoint.architecture
        if arch not in EXLLAMAV2_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"ExLlamaV2 0.3.2 does not load {arch} ({checkpoint.path}): it would read an EXL2 of it as a Llama",
                supported=sorted(EXLLAMAV2_ARCHITECTURES), hint="convert this checkpoint to GGUF or AWQ instead")
        cfg = checkpoint.config.get("text_config") or checkpoint.config
        for key in ("hidden_size", "intermediate_size"):
            value = cfg.get(key)
            if isinstance(value, int) and value % 32:
                raise UnsupportedArchitectureError(
                    f"EXL2 quantizes input widths in groups of 32 rows; {key} of {checkpoint.path} is {value}",
                    supported=["causal LMs whose hidden and intermediate sizes are multiples of 32"])
        if any(self.resolve_spec(s).backend == EXL2Backend.EXLLAMAV2 for s in specs):
            exl2_env.require(self.settings)
        if any(self.resolve_spec(s).backend == EXL2Backend.REFERENCE_CPU for s in specs):
            gaps = reference_codec_gaps(checkpoint.path)
            if gaps:
                raise UnsupportedArchitectureError(
                    f"the reference-cpu EXL2 codec cannot write {arch} ({checkpoint.path}): {gaps[0]}"
                    + (f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else ""),
                    supported=["dense models whose weight matrices are all nn.Linear, stored under the names "
                               "transformers gives them"],
                    hint="on a CUDA machine the exllamav2 backend converts it (--exl2-backend exllamav2); "
                         "here, convert it to GGUF")

    def footprint(self, checkpoint: Checkpoint, source: SourceRef, specs: list[Any]) -> Footprint:
        """ESTIMATES: the reference-cpu codec holds the model in float32 and every linear's input Hessian (in × in,
        float32) at once; the exllamav2 backend works a layer at a time on the GPU (the host holds the source's
        file pages: not counted). A variant is its linears at ``bpw``, the head at ``head_bits``, the embedding in
        float16."""
        facts = checkpoint.facts
        needs: list[Need] = []
        if any(self.resolve_spec(s).backend == EXL2Backend.REFERENCE_CPU for s in specs):
            hessians = sum(4 * t.shape[-1] ** 2 for n, t in checkpoint.tensors.items()
                           if len(t.shape) == 2 and n.endswith(".weight") and ".layers." in n)
            needs.append(Need.of("the reference-cpu EXL2 codec (measurement and GPTQ, float32)",
                                 ("weights", facts.n_params * 4), ("input Hessians", hessians),
                                 ("interpreter", TORCH_PROCESS)).at("prepare:exl2"))
        sizes = {s.name: quantized_bytes(facts, s.bpw, (s.head_bits + 16) / 2) for s in specs}
        return Footprint(needs=tuple(needs), variant_bytes=sizes)

    # -- shared work: the measurement ------------------------------------------------------------

    def _work(self, ctx: BuildContext, spec: EXL2Spec, calibration: Calibration) -> tuple[Path, str]:
        key = _key(ctx.source.identity, self.tool_identity_for(spec), calibration.sha256)
        return self.settings.work_root / "exl2" / key, key

    def artifact_keys(self, ctx: BuildContext, specs: list[Any]) -> list[tuple[str, str]]:
        """Registry artifacts :meth:`prepare` can reuse: exllamav2 measurements of this source."""
        if ctx.calibration is None:
            return []
        out = []
        for spec in specs:
            spec = self.resolve_spec(spec)
            if spec.backend == EXL2Backend.EXLLAMAV2:
                out.append((MEASUREMENT_KIND, self._work(ctx, spec, ctx.calibration)[1]))
        return sorted(set(out))

    def prepare(self, ctx: BuildContext, specs: list[Any]) -> Prepared:
        """Measure once per backend in use (cached in the work folder; exllamav2's also from the registry).
        The reference backend also quantizes every requested bpw in the same worker, while the model
        and Hessians are loaded; :meth:`build` then only collects the folder."""
        if ctx.calibration is None:
            raise ConfigError("EXL2 conversion needs calibration text", hint="the flow passes the checkpoint's "
                              "calibration.txt or the built-in calibration text; pass one explicitly")
        prepared = Prepared()
        concrete = [self.resolve_spec(s) for s in specs]
        for backend in sorted({s.backend for s in concrete}, key=str):
            mine = [s for s in concrete if s.backend == backend]
            folder, key = self._work(ctx, mine[0], ctx.calibration)
            folder.mkdir(parents=True, exist_ok=True)
            workdir.mark_used(folder)
            (folder / "calibration.txt").write_text(ctx.calibration.text, encoding="utf-8")
            if backend == EXL2Backend.EXLLAMAV2:
                calib = self._measure_exllamav2(ctx, folder, key, prepared)
            else:
                calib = self._measure_reference(ctx, folder, mine, prepared)
            calib.update({"origin": ctx.calibration.origin, "sha256": ctx.calibration.sha256})
            prepared.paths[str(backend)] = str(folder)
            prepared.meta[str(backend)] = {"calibration": calib, "key": key}
            prepared.source_artifacts.append({
                "kind": MEASUREMENT_KIND, "key": key, "name": f"measurement-{backend}-{key[:12]}.json",
                "path": str(folder / "measurement.json"), "meta": {"backend": str(backend), "calibration": calib,
                                                                   "tool": self.tool_identity_for(mine[0])}})
        return prepared

    def _measure_reference(self, ctx: BuildContext, folder: Path, specs: list[EXL2Spec],
                           prepared: Prepared) -> dict[str, Any]:
        size = REFERENCE_CALIBRATION
        measured = (folder / "ok").is_file()
        pending = [s for s in specs if not (folder / "variants" / s.name / "done").is_file()]
        if not measured or pending:
            measure = None if measured else {
                "text_file": str(folder / "calibration.txt"), "origin": ctx.calibration.origin if ctx.calibration
                else "", "rows": size.rows, "length": size.length}
            self._run_reference(ctx, folder, "measure" if measure else "quantize", measure, pending)
            (folder / "ok").write_text("")
            if measure:
                prepared.events.append("measure")
            prepared.meta.setdefault("quantized", []).extend(s.name for s in pending)
        calib = dict(json.loads((folder / "measurement.json").read_text())["calibration"])
        return {"rows": calib["rows"], "length": calib["length"], "measurement_rows": calib["rows"],
                "measurement_length": calib["length"], "text_tokens": calib["text_tokens"],
                "ids_sha256": calib["ids_sha256"]}

    def _run_reference(self, ctx: BuildContext, folder: Path, name: str, measure: dict[str, Any] | None,
                       specs: list[EXL2Spec]) -> None:
        """One worker run: optionally measure, then write a folder per spec under ``folder/variants``."""
        result = folder / f"result-{name}.json"
        result.unlink(missing_ok=True)
        jobs: list[dict[str, Any]] = []
        for spec in specs:
            vdir = folder / "variants" / spec.name
            shutil.rmtree(vdir, ignore_errors=True)
            jobs.append({"out": str(vdir / "model"), "bpw": spec.bpw, "head_bits": spec.head_bits,
                         "result": str(vdir / "result.json")})
        req = {"model": str(ctx.checkpoint.path), "measurement": str(folder), "measure": measure, "jobs": jobs,
               "threads": self.settings.threads, "result": str(result)}
        res = run_logged([self.settings.core_python, "-m", REFERENCE_WORKER], log_dir=folder,
                         name=f"reference-{name}", timeout_s=self.settings.convert_timeout_s, env=child_env(),
                         stdin_text=json.dumps(req), keep=self._keep)
        if not res.ok or not result.is_file():
            raise _failed(res, f"reference-cpu EXL2 {name}", folder)
        for job in jobs:
            (Path(job["out"]).parent / "done").write_text("")

    def _measure_exllamav2(self, ctx: BuildContext, folder: Path, key: str, prepared: Prepared) -> dict[str, Any]:
        rt = exl2_env.require(self.settings)
        calib = exllamav2_calibration(ctx.checkpoint, ctx.calibration.text if ctx.calibration else "")
        (folder / "calibration-size.json").write_text(json.dumps(calib))
        measurement = folder / "measurement.json"
        seeded = ctx.artifacts.get(f"{MEASUREMENT_KIND}:{key}")
        if not measurement.is_file() and seeded is not None:
            shutil.copyfile(seeded, measurement)  # measured before (maybe on another machine): reuse it
        if not (folder / "calibration.parquet").is_file():
            req = {"text_file": str(folder / "calibration.txt"), "out": str(folder / "calibration.parquet")}
            res = run_logged([rt.python, "-m", PARQUET_WORKER], log_dir=folder, name="parquet",
                             timeout_s=600, env=child_env(), stdin_text=json.dumps(req), keep=self._keep)
            if not res.ok:
                raise _failed(res, "writing the calibration parquet", folder)
        if not measurement.is_file():
            cmd = [*self._convert_cmd(ctx, folder / "measure-job", folder, calib),
                   "-om", str(measurement), "-mr", str(calib["measurement_rows"]),
                   "-ml", str(calib["measurement_length"])]
            self._run_convert(cmd, folder, "measure", measurement)
            prepared.events.append("measure")
        return calib

    # -- variants --------------------------------------------------------------------------------

    def build(self, ctx: BuildContext, prepared: Prepared, spec: EXL2Spec, out_dir: Path) -> BuiltVariant:
        spec = self.resolve_spec(spec)
        backend = str(spec.backend)
        folder = Path(prepared.paths[backend])
        meta = prepared.meta[backend]
        need = ctx.checkpoint.size_bytes // 2 + (64 << 20)
        free = shutil.disk_usage(self.settings.work_root).free
        if need > free:
            raise DiskFullError(self.settings.work_root, needed=need, free=free)
        out_dir.mkdir(parents=True, exist_ok=True)
        if spec.backend == EXL2Backend.EXLLAMAV2:
            details = self._build_exllamav2(ctx, folder, spec, out_dir, meta["calibration"])
            events = ["quantize"]
        else:
            details, events = self._build_reference(ctx, folder, spec, out_dir, prepared)
        info = inspect_exl2(out_dir, ctx.checkpoint)
        info.update({"backend": backend, "target_bpw": spec.bpw, "head_bits": spec.head_bits})
        params = {"bpw": spec.bpw, "head_bits": spec.head_bits, "backend": backend,
                  "calibration": meta["calibration"], "measurement_key": meta["key"], **details}
        files = {p.name: p for p in sorted(out_dir.iterdir()) if p.is_file()}
        return BuiltVariant(variant=spec.name, files=files, tool=self.tool_identity_for(spec), parameters=params,
                            events=events, info=info)

    def _build_reference(self, ctx: BuildContext, folder: Path, spec: EXL2Spec, out_dir: Path,
                         prepared: Prepared) -> tuple[dict[str, Any], list[str]]:
        vdir = folder / "variants" / spec.name
        quantized = spec.name in prepared.meta.get("quantized", [])
        if not (vdir / "done").is_file():  # prepared for other specs, or the work folder was cleaned since
            self._run_reference(ctx, folder, f"quantize-{spec.name}", None, [spec])
            quantized = True
        for item in sorted((vdir / "model").iterdir()):
            shutil.copyfile(item, out_dir / item.name)
        return dict(json.loads((vdir / "result.json").read_text())), (["quantize"] if quantized else [])

    def _build_exllamav2(self, ctx: BuildContext, folder: Path, spec: EXL2Spec, out_dir: Path,
                         calib: dict[str, Any]) -> dict[str, Any]:
        job = folder / f"bpw-{spec.bpw:.2f}-h{spec.head_bits}"
        model = job / "model"
        if not (job / "done").is_file():
            cmd = [*self._convert_cmd(ctx, job, folder, calib), "-m", str(folder / "measurement.json"),
                   "-b", str(spec.bpw), "-hb", str(spec.head_bits), "-cf", str(model)]
            self._run_convert(cmd, job, "convert", model / "config.json")
            (job / "done").write_text("")
        for item in sorted(model.iterdir()):
            if item.is_file():
                shutil.copyfile(item, out_dir / item.name)
        return {"work_dir": str(job)}

    def _convert_cmd(self, ctx: BuildContext, job: Path, folder: Path, calib: dict[str, Any]) -> list[str]:
        rt = exl2_env.require(self.settings)
        job.mkdir(parents=True, exist_ok=True)
        return [rt.python, "-m", CONVERT_MODULE, "-i", str(ctx.checkpoint.path), "-o", str(job),
                "-c", str(folder / "calibration.parquet"), "-r", str(calib["rows"]), "-l", str(calib["length"])]

    def _run_convert(self, cmd: list[str], log_dir: Path, name: str, expect: Path) -> None:
        # convert_exl2 resumes from job_new.json when its -o folder holds one; it also exits 0 on some
        # errors, so success is judged by the file it must have written.
        res = run_logged(cmd, log_dir=log_dir, name=name, timeout_s=self.settings.convert_timeout_s,
                         env=child_env({"PYTHONUNBUFFERED": "1"}), keep=self._keep)
        if not res.ok or not expect.exists():
            raise _failed(res, f"exllamav2 convert_exl2 ({name})", log_dir)


def exllamav2_calibration(ckpt: Checkpoint, text: str, size: CalibrationSize = EXLLAMAV2_CALIBRATION
                          ) -> dict[str, Any]:
    """exllamav2's rows × length, capped so the text holds them (its tokenizer may split a little
    differently from transformers', hence the 2 % margin)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt.path), trust_remote_code=False)
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    usable = int(n * 0.98)
    max_ctx = (ckpt.config.get("text_config") or ckpt.config).get("max_position_embeddings") or size.length
    length = min(size.length, int(max_ctx), usable)
    m_length = min(size.measurement_length, int(max_ctx), usable)
    if length < 16:
        raise ConfigError(f"the calibration text has {n} tokens: too few for EXL2 calibration",
                          hint="give a calibration text of thousands of tokens")
    return {"rows": max(1, min(size.rows, usable // length)), "length": length,
            "measurement_rows": max(1, min(size.measurement_rows, usable // m_length)),
            "measurement_length": m_length, "text_tokens": n}


def reference_codec_gaps(path: Path) -> list[str]:
    """What the reference codec could not write faithfully for the checkpoint at ``path`` (empty: nothing).

    It quantizes the ``nn.Linear`` layers of the model transformers builds and writes every tensor under that
    model's names, as ExLlamaV2 reads a checkpoint's. Two things break that, both found on the meta device
    (no weights read): a weight matrix outside ``nn.Linear`` (transformers 5 fuses a MoE layer's experts
    into one 3-D parameter; GPT-2's layers are ``Conv1D``), which would be stored unquantized in a file named
    for its bits per weight; and names transformers changes as it loads (its conversion mapping, e.g.
    GPT-NeoX's ``embed_out``), which ExLlamaV2 would not find."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    written = {f"{name}.weight" for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear | torch.nn.Embedding)}
    state = model.state_dict()
    outside = sorted(((name, t) for name, t in state.items() if t.ndim >= 2 and name not in written),
                     key=lambda item: -item[1].numel())  # the largest first: fused experts before a router
    gaps = [f"{name} (shape {list(t.shape)}) is not an nn.Linear weight: it would stay unquantized"
            for name, t in outside]
    saved = revert_weight_conversion(model, dict(state))
    renamed = sorted(set(state) - set(saved))
    if renamed:
        gaps.append(f"transformers renames {renamed[0]} as it loads it ({len(renamed)} tensors): the file would "
                    "not use the checkpoint's names")
    return gaps

def _failed(res: ProcResult, what: str, folder: Path) -> Exception:
    if res.disk_full:
        return DiskFullError(folder)
    return ConversionError(f"{what} {res.describe()}", stderr_tail=res.stderr_tail or res.stdout_tail,
                           hint=f"full log: {res.log}; re-running resumes from the work folder {folder}")


def inspect_exl2(folder: Path, ckpt: Checkpoint | None = None) -> dict[str, Any]:
    """Check an EXL2 folder's layout (every layer's groups against its tensor shapes, from headers and
    the small index tensors) and size it: bits per weight of the whole file and of the decoder layers.
    Without the source checkpoint ``ckpt``, shapes come from the folder alone and the whole-file ``bpw``
    is None.

    Raises ConversionError when the folder is not a consistent EXL2 model.
    """
    from safetensors import safe_open

    from pipeline.errors import EXL2FormatError
    from pipeline.exl2_codec import decode_groups, padded, storage_bits

    config = json.loads((folder / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") != "exl2":
        raise ConversionError(f"{folder}/config.json lacks quantization_config.quant_method = exl2")
    files = sorted(folder.glob("*.safetensors"))
    headers = {name: (f, info) for f in files for name, info in read_safetensors_header(f).items()}
    total_bits = sum(os.path.getsize(f) * 8 for f in files)
    layers: dict[str, dict[str, Any]] = {}
    try:
        for name in sorted(n[: -len(".q_weight")] for n in headers if n.endswith(".q_weight")):
            path, qw = headers[f"{name}.q_weight"]
            with safe_open(str(path), framework="pt") as fh:
                groups = decode_groups(fh.get_tensor(f"{name}.q_groups"), headers[f"{name}.q_invperm"][1].shape[0])
            source = ckpt.tensors.get(f"{name}.weight") if ckpt is not None else None
            out_f, in_f = (source.shape if source else (qw.shape[1], headers[f"{name}.q_invperm"][1].shape[0]))
            bias = f"{name}.bias" in headers
            bits = storage_bits(groups, in_f, out_f, bias)
            on_disk = sum(_nbytes(headers[f"{name}.{s}"][1]) * 8 for s in
                          ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", *(("bias",) if bias else ())))
            if qw.shape != (sum(g.rows * g.bits // 32 for g in groups), padded(out_f)):
                raise EXL2FormatError(f"{name}.q_weight is {list(qw.shape)}, its groups need "
                                      f"{[sum(g.rows * g.bits // 32 for g in groups), padded(out_f)]}")
            layers[name] = {"numel": out_f * in_f, "bits": bits, "on_disk_bits": on_disk,
                            "groups": len(groups), "widths": sorted({g.bits for g in groups}, reverse=True)}
    except EXL2FormatError as exc:
        raise ConversionError(f"{folder} is not a consistent EXL2 model: {exc.message}") from exc
    head = next((n for n in layers if n.endswith("lm_head")), None)
    decoder = {n: v for n, v in layers.items() if n != head}
    dec_numel = sum(v["numel"] for v in decoder.values()) or 1
    return {"size": total_bits // 8, "tensor_count": len(headers), "quantized_layers": len(layers),
            "bpw": round(total_bits / ckpt.n_params, 4) if ckpt is not None and ckpt.n_params else None,
            "decoder_bpw": sum(v["bits"] for v in decoder.values()) / dec_numel,
            "decoder_bpw_on_disk": sum(v["on_disk_bits"] for v in decoder.values()) / dec_numel,
            "head_bpw": (layers[head]["bits"] / layers[head]["numel"]) if head else None,
            "head_widths": layers[head]["widths"] if head else None}


def _nbytes(info: Any) -> int:
    count = 1
    for d in info.shape:
        count *= d
    return count * {"I32": 4, "I16": 2, "F16": 2, "F32": 4, "BF16": 2}.get(info.dtype, 4)


__all__ = ["EXL2Converter", "inspect_exl2"]
