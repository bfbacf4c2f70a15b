"""GGUF converter: llama.cpp's own HF→GGUF script once per source, then every type from that base.

* The base (F16, or BF16 for bf16 sources) is written by ``convert_hf_to_gguf.py``
  from the pinned llama-cpp-python sdist, run as a subprocess with that sdist's
  ``gguf-py`` first on ``PYTHONPATH`` (PyPI ``gguf`` is too old for the script).
* Each type is produced from the base by ``llama-quantize`` under a small worker subprocess
  (``converters.gguf.workers.quantize``): byte-identical to ``llama_model_quantize``, and a crash
  there cannot take the flow down.
* imatrix quants (``i1-*``) use an importance matrix computed once per source and calibration
  text by ``llama-imatrix`` on the base (``converters.gguf.imatrix``) and ``llama-quantize --imatrix``.
* Every output's header is read (``converters.gguf.header``: architecture, file type, tensor count, in
  milliseconds where gguf-py's reader takes seconds) and checked against the base, and its tokenizer is
  checked for parity with the HF tokenizer (``converters.gguf.tokenizer``) once per distinct tokenizer
  metadata: the types of one base carry the base's, proven equal by digest, so the check runs on the base
  while llama-quantize makes the first type, and each file then finds it by its digest. Then it is optionally split
  into parts by ``llama-gguf-split`` (``converters.gguf.split``).

The base is cached under ``WORK/gguf-base/<source>/<toolchain>/`` so that adding a
type later, or re-running, never converts twice; the imatrix is cached next to it.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from converters.base import BuildContext, BuiltVariant, Footprint, Prepared
from converters.checkpoint import Checkpoint
from converters.gguf.header import GGUFHeader, read_header
from converters.gguf.imatrix import ImatrixRequest, ensure_imatrix
from converters.gguf.sanity import gguf_sanity, gguf_structure
from converters.gguf.split import inspect_headers, inspect_parts, split_gguf
from converters.gguf.tokenizer import check_parity, parity_key, record_parity, recorded_parity
from pipeline import workdir
from pipeline.config import Settings
from pipeline.errors import (
    ConfigError,
    ConversionError,
    DiskFullError,
    InvalidSpecError,
    NotFoundError,
    TokenizerUnsupportedError,
    UnsupportedArchitectureError,
)
from pipeline.footprint import ModelFacts, gguf_conversion, gguf_quantize, llama_cpp_run, quantized_bytes
from pipeline.fs import atomic_path, write_atomic
from pipeline.llama_cpp import LlamaCppToolchain, llama_cpp_toolchain
from pipeline.plan import GGUFOptions
from pipeline.proc import failure_log_dir, run_logged
from pipeline.progress import convert_line, quantize_line
from pipeline.specs import GGUF_BASE_TYPES, GGUFSpec, GGUFType, QuantFormat, SourceRef
from pipeline.texts import file_text, text_sha256

WORKER = "converters.gguf.workers.quantize"
CONVERT_WORKER = "converters.gguf.workers.hf_to_gguf"  # the converter, told converter_overrides
LOADS_WORKER = "converters.gguf.workers.loads"  # does llama.cpp load what its converter wrote?
IMATRIX_KIND = "imatrix"
PARITY_DIR = "gguf-parity"  # under the work dir: recorded tokenizer agreements, by parity key


def choose_base_type(ckpt: Checkpoint, requested: str = "auto") -> str:
    """F16 for fp16/fp32 sources, BF16 for bf16 ones (bf16→f16 can overflow), unless told otherwise."""
    if requested != "auto":
        return requested.upper()
    return "BF16" if "bfloat16" in ckpt.torch_dtype else "F16"


#: The GGUF float type that holds each checkpoint dtype exactly
_EXACT_TYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def converted_directly(ckpt: Checkpoint, base_type: str, spec: GGUFSpec) -> bool:
    """Whether the float type ``spec`` is converted from the checkpoint by llama.cpp's converter rather than made
    from the base by llama-quantize: where the base does not hold the source's values exactly (the F16 base of an
    fp32 source), llama-quantize would store F16's rounding as F32, or round F16's rounding again to BF16 (with
    F16's range), which is not what F32 or BF16 means in llama.cpp's tables (``convert_hf_to_gguf.py --outtype``
    from the checkpoint). The source's dtype is that of most stored weights (config.json's where none is stored
    as a float: a config can say float16 over fp32 weights)."""
    if spec.imatrix or spec.type not in GGUF_BASE_TYPES or spec.type == base_type:
        return False
    stored = ckpt.stored_dtype or ckpt.torch_dtype  # what the weights are, whatever config.json says
    source = _EXACT_TYPE.get(stored.removeprefix("torch."))
    return not (base_type == "F32" or source == base_type)


class GGUFConverter:
    format: ClassVar[QuantFormat] = QuantFormat.GGUF

    def __init__(self, settings: Settings, options: GGUFOptions | None = None) -> None:
        """``options``: the plan's GGUF options (base type, split size, imatrix calibration, tokenizer override)."""
        self.settings = settings
        self.python = settings.core_python
        self.options = options if options is not None else GGUFOptions()
        self.base_type = self.options.base_type

    @staticmethod
    def prepare_inputs(options: dict[str, Any], specs: list[Any]) -> dict[str, Any]:
        """What the shared preparation depends on (a distributed run's prepare-stage key): the base type, and
        the imatrix calibration when a variant needs one; adding a type reuses the base."""
        imatrix = any(getattr(s, "imatrix", False) for s in specs)
        return {"base_type": options.get("base_type", "auto"),
                "imatrix": options.get("calibration") if imatrix else None}

    # -- a plain file (validate) -----------------------------------------------------------------

    @staticmethod
    def describe(path: Path) -> tuple[str, dict[str, Any]]:
        """The variant name and spec of a plain GGUF file (or folder of parts), from its file type; a file
        too damaged to say is named ``unknown`` (the format check then reports what is wrong)."""
        first = path if path.is_file() else sorted(path.glob("*.gguf"))[0]
        try:
            ftype = read_header(first).get("general.file_type")
            name = GGUFType(int(ftype)).name if ftype is not None else None
        except Exception:
            name = None
        return (name, {"type": name}) if name else ("unknown", {})

    @staticmethod
    def read_structure(path: Path) -> None:
        """Raise InvalidArtifactError when ``path`` (a file or a folder of parts) cannot be read as GGUF."""
        for part in ([path] if path.is_file() else sorted(path.glob("*.gguf"))):
            gguf_structure(part)

    @staticmethod
    def sanity(model: Path, files: list[Path]) -> tuple[str, dict[str, Any]]:
        """Every part checked with gguf-py (architecture, file type, tensors, tokenizer). Raises
        InvalidArtifactError."""
        parts = sorted(p for p in files if p.name.endswith(".gguf"))
        summary = gguf_sanity(parts[0])
        for part in parts[1:]:
            gguf_sanity(part, first_part=False)
        return (f"GGUF {summary['architecture']} file type {summary['file_type']}, {summary['tensors']} tensors, "
                f"tokenizer {summary['tokenizer_model']}"), summary

    def tokenizer_parity(self, model: Path, checkpoint: Path, texts: dict[str, str], log_dir: Path) -> dict[str, Any]:
        """The GGUF's tokenization of the probe and ``texts`` against the HF tokenizer of ``checkpoint``.
        Raises TokenizerMismatchError at the first differing token."""
        return check_parity(model, checkpoint, python=self.python, env=self.llama_cpp().env(), log_dir=log_dir,
                            timeout_s=600, allow=False, texts=texts)

    @staticmethod
    def recorded_options(lineage: dict[str, Any], artifact: Callable[[str, str], Path | None],
                         work: Path) -> GGUFOptions:
        """The options a registered variant was built with, for rebuilding it: ``lineage["options"]``
        (versions registered before it was recorded: what ``lineage["parameters"]`` shows). The imatrix
        calibration text is the registry's copy (``artifact(kind, key)`` finds a source artifact's file), so
        a rebuild needs no file of the first machine.

        Raises NotFoundError when the calibration text is no longer in the registry.
        """
        params = lineage.get("parameters") or {}
        options = dict(lineage.get("options") or {})
        if not options:
            split = params.get("split") or {}
            options = {"base_type": params.get("base_type", "auto"), "split_max_size": split.get("max_size")}
        imatrix = params.get("imatrix")
        if imatrix:
            digest = imatrix["calibration_sha256"]
            stored = artifact("calibration", digest)
            if stored is None:
                raise NotFoundError(f"the imatrix calibration text (sha256 {digest[:16]}…) recorded in the lineage "
                                    "is not in the registry", hint="register the variant again to store it")
            text = work / f"calibration-{digest[:16]}.txt"
            shutil.copyfile(stored, text)
            options["calibration"] = {**(options.get("calibration") or {}), "file": str(text),
                                      "chunks": imatrix.get("chunks_requested"), "context": imatrix.get("context", 512)}
        return GGUFOptions.model_validate(options)

    # -- identity and checks ---------------------------------------------------------------------

    def llama_cpp(self) -> LlamaCppToolchain:
        """The llama.cpp this converter runs (pipeline/llama_cpp.py). Raises ToolchainMissingError."""
        return llama_cpp_toolchain(self.settings)

    def tool_identity(self) -> dict[str, Any]:
        tc = self.llama_cpp().meta()
        return {"name": "llama.cpp", "llama_cpp_python": tc["llama_cpp_python"],
                "llama_cpp_commit": tc["llama_cpp_commit"], "gguf_py": tc["gguf_py"],
                "sdist_sha256": tc["sdist_sha256"]}

    def require_tools(self) -> None:
        """Raise ToolchainMissingError when llama.cpp's converter is not set up (before any work on the source)."""
        self.llama_cpp().meta()

    def check(self, checkpoint: Checkpoint, specs: list[Any]) -> None:
        meta = self.llama_cpp().meta()
        supported = list(meta["supported_architectures"])
        arch = checkpoint.architecture
        if arch not in supported:
            raise UnsupportedArchitectureError(
                f"architecture {arch} is not supported by llama.cpp's converter "
                f"(llama-cpp-python {meta['llama_cpp_python']})",
                supported=supported,
                hint="supported architectures: " + ", ".join(supported))
        blind = [s.type for s in specs if s.requires_imatrix and not s.imatrix]
        if blind:
            raise InvalidSpecError(f"{', '.join(blind)} need(s) an importance matrix",
                                   hint="request them with --imatrix (optionally --calibration FILE)")

    def footprint(self, checkpoint: Checkpoint, source: SourceRef, specs: list[Any]) -> Footprint:
        """ESTIMATES: the base conversion, llama-quantize and (for i1- types) llama-imatrix; the base (and any
        float type converted from the checkpoint) in the work folder where it is not cached yet; each type's size
        (:func:`estimated_bytes`)."""
        facts = checkpoint.facts
        base_type = choose_base_type(checkpoint, self.base_type)
        ctx = BuildContext(checkpoint=checkpoint, source=source, model_name=checkpoint.path.name,
                           settings=self.settings)
        folders = {base_type, *(s.type for s in specs if converted_directly(checkpoint, base_type, s))}
        work = sum(estimated_bytes(facts, t) for t in folders if not (self._base_dir(ctx, t) / "ok").is_file())
        needs = [gguf_conversion(facts).at("prepare:gguf")]
        if any(s.type not in GGUF_BASE_TYPES for s in specs):
            needs.append(gguf_quantize(facts).at("build:*"))
        if any(s.imatrix for s in specs):
            imatrix = llama_cpp_run(facts, estimated_bytes(facts, base_type), False, self.options.calibration.context,
                                    "llama-imatrix on the base")
            needs.append(imatrix.at("prepare:gguf"))
        return Footprint(needs=tuple(needs), work_bytes=work,
                         variant_bytes={s.name: estimated_bytes(facts, s.type) for s in specs})

    # -- base ------------------------------------------------------------------------------------

    def _base_dir(self, ctx: BuildContext, base_type: str) -> Path:
        """The base's cache folder: keyed by the source, the base type, the toolchain and what the converter is
        told (:func:`converter_overrides`, where any), so a base converted before an override changed is not
        reused."""
        parts: list[Any] = [ctx.source.identity, base_type, self.tool_identity()]
        if overrides := converter_overrides(ctx.checkpoint):
            parts.append(overrides)
        key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
        return ctx.settings.work_root / "gguf-base" / key

    def prepare(self, ctx: BuildContext, specs: list[Any]) -> Prepared:
        """Return the cached base GGUF for this source (converting it only if it is missing) and, when
        any of ``specs`` is an imatrix quant, the cached importance matrix (computing it only if missing).

        Raises:
            ConfigError: imatrix quants were requested but no calibration was given.
        """
        base_type = choose_base_type(ctx.checkpoint, self.base_type)
        base, converted = self._converted(ctx, base_type)
        prepared = Prepared(paths={"base": str(base)}, meta={"base_type": base_type})
        if converted:
            prepared.events.append("convert_base")
        prepared.meta["base_info"] = _base_info(base.parent / "ok", base)
        if any(getattr(s, "imatrix", False) for s in specs):
            self._prepare_imatrix(ctx, prepared, base, base_type)
        return prepared

    def _converted(self, ctx: BuildContext, gguf_type: str) -> tuple[Path, bool]:
        """The checkpoint converted by llama.cpp's converter to the float type ``gguf_type``, from its cache
        folder (converted now if missing: then True)."""
        folder = self._base_dir(ctx, gguf_type)
        path = folder / f"{ctx.file_stem}-{gguf_type}.gguf"
        converted = False
        if not (path.is_file() and (folder / "ok").is_file()):
            folder.mkdir(parents=True, exist_ok=True)
            self._convert(ctx, gguf_type, path)
            (folder / "ok").write_text(json.dumps(inspect_gguf(path)))
            converted = True
        workdir.mark_used(folder)
        return path, converted

    # -- the importance matrix -------------------------------------------------------------------

    def calibration_file(self, ctx: BuildContext) -> tuple[Path, str]:
        """The imatrix calibration text as a content-addressed file under the work dir (its stem is its
        sha256), and where it came from: ``options.calibration.file``, else the run's calibration text
        (the checkpoint's own, else the built-in one).

        Raises ConfigError when the calibration file does not exist or the run has no calibration text.
        """
        name = self.options.calibration.file
        if name:
            text, origin = file_text(name, what="calibration text", hint="pass an existing --calibration FILE")
        elif ctx.calibration is not None:
            text, origin = ctx.calibration.text, ctx.calibration.origin
        else:
            raise ConfigError("imatrix quants were requested but no calibration text was given",
                              hint="pass --imatrix (the default calibration text is used without --calibration)")
        path = ctx.settings.work_root / "calibration" / f"{text_sha256(text)}.txt"
        if not path.is_file():
            write_atomic(path, text)
        workdir.mark_used(path)
        return path, origin

    def imatrix_request(self, ctx: BuildContext) -> ImatrixRequest:
        path, origin = self.calibration_file(ctx)
        return ImatrixRequest(calibration=path, origin=origin, chunks=self.options.calibration.chunks,
                              context=self.options.calibration.context)

    def imatrix_key(self, ctx: BuildContext) -> str:
        """Key of the importance matrix this run's calibration gives on this source's base."""
        base_type = choose_base_type(ctx.checkpoint, self.base_type)
        return self.imatrix_request(ctx).key(base_type, self.tool_identity())

    def artifact_keys(self, ctx: BuildContext, specs: list[Any]) -> list[tuple[str, str]]:
        """Registry artifacts :meth:`prepare` can reuse: the importance matrix, when a variant needs one."""
        return [(IMATRIX_KIND, self.imatrix_key(ctx))] if any(getattr(s, "imatrix", False) for s in specs) else []

    def build_inputs(self, ctx: BuildContext, spec: GGUFSpec) -> dict[str, Any]:
        """Inputs besides the spec that change a variant's bytes (part of its build key): what the converter is
        told (:func:`converter_overrides`), a forced base type, the split size, and for imatrix quants the
        calibration text, chunks and context."""
        out: dict[str, Any] = {}
        if overrides := converter_overrides(ctx.checkpoint):
            out["converter_overrides"] = overrides
        if self.options.base_type != "auto":
            out["base_type"] = self.options.base_type
        if converted_directly(ctx.checkpoint, choose_base_type(ctx.checkpoint, self.base_type), spec):
            out["converted_directly"] = True  # before, such a type was made from the base (F16's rounding)
        if self.options.split_max_size:
            out["split_max_size"] = self.options.split_max_size
        if spec.imatrix:
            path, _ = self.calibration_file(ctx)
            out["imatrix"] = {"calibration_sha256": path.stem, "chunks": self.options.calibration.chunks,
                              "context": self.options.calibration.context}
        return out

    def _prepare_imatrix(self, ctx: BuildContext, prepared: Prepared, base: Path, base_type: str) -> None:
        request = self.imatrix_request(ctx)
        key = request.key(base_type, self.tool_identity())
        existing = ctx.artifacts.get(f"{IMATRIX_KIND}:{key}")  # the registry's copy: a cleaned work dir costs nothing
        path, meta, computed = ensure_imatrix(base, base.parent, replace(request, existing=existing), key,
                                              toolchain=self.llama_cpp(),
                                              threads=ctx.settings.threads, timeout_s=ctx.settings.convert_timeout_s,
                                              python=self.python, keep=failure_log_dir(ctx.settings.logs_root))
        prepared.paths["imatrix"] = str(path)
        prepared.paths["calibration"] = str(request.calibration)
        prepared.meta["imatrix"] = meta
        if computed:
            prepared.events.append("imatrix")
        # registered as artifacts of the source (idempotent), so that another run or machine reuses them
        digest = meta["calibration_sha256"]
        prepared.source_artifacts += [
            {"kind": "calibration", "key": digest, "name": f"{ctx.file_stem}-calibration-{digest[:12]}.txt",
             "path": str(request.calibration),
             "meta": {"sha256": digest, "origin": meta["calibration_origin"], "bytes": meta["calibration_bytes"]}},
            {"kind": IMATRIX_KIND, "key": meta["key"], "name": f"{ctx.file_stem}-imatrix-{meta['key'][:12]}.gguf",
             "path": str(path), "meta": {**meta, "base_type": base_type}}]

    def _convert(self, ctx: BuildContext, base_type: str, dest: Path) -> None:
        need = int(ctx.checkpoint.n_params * 2 * 1.05) + (ctx.settings.disk_headroom_mb << 20)
        free = shutil.disk_usage(dest.parent).free
        if need > free:
            raise DiskFullError(dest.parent, needed=need, free=free)
        with atomic_path(dest) as tmp:  # unique name: concurrent runs never clash; removed on failure
            tools = self.llama_cpp()
            args = [str(ctx.checkpoint.path), "--outfile", str(tmp), "--outtype", base_type.lower(),
                    "--model-name", ctx.file_stem]
            given = converter_overrides(ctx.checkpoint)
            cmd = ([self.python, "-m", CONVERT_WORKER, str(tools.converter), json.dumps(given), *args] if given
                   else [self.python, str(tools.converter), *args])
            res = run_logged(cmd, log_dir=dest.parent, name="convert", timeout_s=ctx.settings.convert_timeout_s,
                             env=tools.converter_env(), keep=failure_log_dir(ctx.settings.logs_root),
                             progress=convert_line)
            if not res.ok:
                raise _conversion_error(res.stderr_tail, res.describe(), res.log, ctx.checkpoint)
            self._check_loads(ctx, tmp, dest.parent, name=dest.name)

    def _check_loads(self, ctx: BuildContext, gguf: Path, log_dir: Path, name: str) -> None:
        """llama.cpp must load what its converter wrote. The converter writes some hyperparameters from what an
        architecture usually has (Phi-2's FFN width as 4 × hidden, no grouped K/V heads), so a checkpoint whose
        config differs converts and is refused at load: a tensor whose shape does not fit. Checked on the base,
        metadata only (converters/gguf/workers/loads.py: 0.2 s with the worker's start for the 135 M base, no weight
        read at any size), before any type is made from it, so nothing llama.cpp cannot run is built, registered or
        evaluated.

        Raises:
            ConversionError: llama.cpp refuses the file; the cause is its loader's own reason.
        """
        with tempfile.TemporaryDirectory(dir=log_dir) as tmp:
            output = Path(tmp) / "loads.json"
            request = {"model": str(gguf), "output": str(output), "name": name}
            res = run_logged([self.python, "-m", LOADS_WORKER], log_dir=log_dir, name="loads",
                             timeout_s=ctx.settings.convert_timeout_s, env=self.llama_cpp().env(),
                             stdin_text=json.dumps(request), keep=failure_log_dir(ctx.settings.logs_root))
            if not res.ok or not output.is_file():
                ckpt = ctx.checkpoint
                raise ConversionError(
                    f"llama.cpp cannot load the GGUF its converter wrote from {ckpt.path} ({ckpt.architecture}; "
                    f"the load check {res.describe()})", stderr_tail=res.stderr_tail,
                    hint=f"llama.cpp's {ckpt.architecture} does not support something in this checkpoint's "
                         f"config.json (the converter wrote hyperparameters the tensors do not fit); convert it "
                         f"to another format, or see the log {res.log}")

    # -- variants --------------------------------------------------------------------------------

    def build(self, ctx: BuildContext, prepared: Prepared, spec: GGUFSpec, out_dir: Path) -> BuiltVariant:
        """Make one variant from the base: quantize (with the imatrix for ``i1-`` types), check the file and
        its tokenizer, split it if asked. Raises ConversionError, TokenizerMismatchError, DiskFullError."""
        base = Path(prepared.paths["base"])
        base_type = str(prepared.meta["base_type"])
        out_dir.mkdir(parents=True, exist_ok=True)
        out = out_dir / f"{ctx.file_stem}-{spec.name}.gguf"
        events: list[str] = []
        if spec.imatrix and "imatrix" not in prepared.paths:
            raise ConfigError(f"{spec.name} is an imatrix quant but no importance matrix was prepared",
                              hint="prepare the format with the imatrix variants in its spec list")
        base_info = prepared.meta.get("base_info") or inspect_gguf(base)
        direct = converted_directly(ctx.checkpoint, base_type, spec)
        if direct:  # the base does not hold the source exactly: this float type comes from the checkpoint
            made, converted = self._converted(ctx, spec.type)
            shutil.copyfile(made, out)
            events.extend(["convert"] if converted else [])
        elif spec.type == base_type and not spec.imatrix:
            shutil.copyfile(base, out)  # the base is this variant; the blob store dedups identical bytes
        else:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gguf-parity") as pool:
                self._parity_ahead(pool, ctx, spec, base, out_dir)
                self._quantize(ctx, base, out, spec, prepared)
            events.append("quantize")
        header = read_header(out)
        info = inspect_headers([header])
        _check_output(out, info, spec, base_info)
        tools = self.llama_cpp()
        parity = self._parity(ctx, spec, header, out_dir)
        parts = [out]
        if self.options.split_max_size:
            parts = split_gguf(out, self.options.split_max_size, toolchain=tools,
                               timeout_s=ctx.settings.convert_timeout_s, keep=failure_log_dir(ctx.settings.logs_root))
            events.append("split")
            info = inspect_parts(parts)
            _check_output(parts[0], info, spec, base_info)
        params: dict[str, Any] = {
            "type": spec.type, "base_type": spec.type if direct else base_type,
            "imatrix": prepared.meta.get("imatrix") if spec.imatrix else None,
            "split": {"max_size": self.options.split_max_size, "parts": len(parts)}
            if self.options.split_max_size else None,
            "tokenizer_parity": parity}
        if given := converter_overrides(ctx.checkpoint):
            params["converter_overrides"] = given  # what llama.cpp's converter was told beyond the checkpoint
        if differs := llama_cpp_divergences(ctx.checkpoint.config):
            params["llama_cpp_divergences"] = differs
        return BuiltVariant(variant=spec.name, files={p.name: p for p in parts}, tool=self.tool_identity(),
                            parameters=params, events=events, info=info)

    def _parity_ahead(self, pool: ThreadPoolExecutor, ctx: BuildContext, spec: GGUFSpec, base: Path,
                      log_dir: Path) -> None:
        """Check the base's tokenizer parity in ``pool`` while llama-quantize makes a type from it (the thread ends
        at once when an agreement is recorded for the base's tokenizer metadata already).

        Every type made from a base carries the base's ``tokenizer.*`` metadata byte for byte, so the build's own
        check of the new file (:meth:`_parity`, after quantization) then finds the base's agreement by digest
        instead of starting llama.cpp: the first type of a run pays for its quantization only, not for the
        quantization and then the check. What is proven is unchanged: the file's digest must equal the base's
        for the record to apply, else the file is checked itself. A mismatch is never recorded, so it is found
        again on the file and reported as before (the error here is dropped); for the same reason nothing is
        checked ahead when mismatches are allowed (each type is checked on its own file).
        """
        if self.options.allow_tokenizer_mismatch:
            return
        pool.submit(lambda: self._parity(ctx, spec, read_header(base), log_dir))

    def _parity(self, ctx: BuildContext, spec: GGUFSpec, header: GGUFHeader, log_dir: Path) -> dict[str, Any]:
        """Tokenizer parity of the GGUF ``header`` was read from: recorded when a GGUF with the same tokenizer
        metadata digest was checked against the same HF tokenizer files, texts and tools (every type of one
        base), else checked by llama.cpp now and recorded if it agrees. The lineage record says which.
        Raises TokenizerMismatchError, ConversionError (see :func:`check_parity`)."""
        texts = self._parity_texts(ctx, spec)
        allow = self.options.allow_tokenizer_mismatch
        digest = header.tokenizer_sha256
        key = parity_key(digest, ctx.checkpoint.path, texts, allow=allow,
                         engine={**self.tool_identity(), "architecture": header.get("general.architecture")})
        folder = ctx.settings.work_root / PARITY_DIR
        known = recorded_parity(folder, key)
        if known is not None:
            workdir.mark_used(folder / f"{key}.json")
            return {**known["record"], "tokenizer_sha256": digest,
                    "checked": f"identical tokenizer metadata, checked on {known['checked_on']}"}
        record = check_parity(header.path, ctx.checkpoint.path, python=self.python, env=self.llama_cpp().env(),
                              log_dir=log_dir, timeout_s=ctx.settings.convert_timeout_s, allow=allow, texts=texts,
                              keep=failure_log_dir(ctx.settings.logs_root))
        record_parity(folder, key, record, checked_on=header.path.name)
        return {**record, "tokenizer_sha256": digest, "checked": "this file"}

    def _parity_texts(self, ctx: BuildContext, spec: GGUFSpec) -> dict[str, str]:
        """The run's texts, plus the imatrix calibration file this variant was calibrated on."""
        if not (spec.imatrix and self.options.calibration.file):
            return ctx.texts
        path, origin = self.calibration_file(ctx)
        return {**ctx.texts, origin: path.read_text(encoding="utf-8")}

    def _quantize(self, ctx: BuildContext, base: Path, out: Path, spec: GGUFSpec, prepared: Prepared) -> None:
        need = base.stat().st_size + (ctx.settings.disk_headroom_mb << 20)
        free = shutil.disk_usage(out.parent).free
        if need > free:
            raise DiskFullError(out.parent, needed=need, free=free)
        tools = self.llama_cpp()
        with atomic_path(out) as tmp:  # llama-quantize writes it; removed on failure
            request = {"input": str(base), "output": str(tmp), "ftype": spec.file_type,
                       "nthread": ctx.settings.threads,
                       "imatrix": prepared.paths.get("imatrix") if spec.imatrix else None,
                       "bin_dir": str(tools.bin_dir)}
            res = run_logged([self.python, "-m", WORKER], log_dir=out.parent, name=f"quantize-{spec.name}",
                             timeout_s=ctx.settings.convert_timeout_s, env=tools.env(),
                             stdin_text=json.dumps(request), keep=failure_log_dir(ctx.settings.logs_root),
                             progress=quantize_line)
            if not res.ok:
                if res.disk_full:
                    raise DiskFullError(out.parent, needed=need)
                raise ConversionError(f"llama.cpp quantization to {spec.type} {res.describe()}",
                                      stderr_tail=res.stderr_tail,
                                      hint=f"see the log {res.log}")


def type_bits(gguf_type: str) -> float:
    """Bits per weight of a llama.cpp file type's main tensor type (gguf-py's GGML_QUANT_SIZES: Q4_K_M → Q4_K, 4.5),
    8.5 where the name does not say it."""
    import gguf

    name = gguf_type.upper()
    if name in ("F32", "F16", "BF16"):
        return {"F32": 32.0, "F16": 16.0, "BF16": 16.0}[name]
    for candidate in (name, re.sub(r"_(S|M|L|XL)$", "", name)):
        member = getattr(gguf.GGMLQuantizationType, candidate, None)
        if member is not None:
            block, size = gguf.GGML_QUANT_SIZES[member]
            return size * 8 / block
    return 8.5


def estimated_bytes(facts: ModelFacts, gguf_type: str) -> int:
    """ESTIMATE of a GGUF's size: the body at its main type's bits (+10 % for the mixes' larger tensors), the
    token embedding and output head at up to Q8_0's 8.5 bits (the mixes keep them wider), float types exact."""
    bits = type_bits(gguf_type)
    if bits >= 16:
        return int(facts.n_params * bits / 8) + (1 << 20)
    return quantized_bytes(facts, bits * 1.1, max(bits, 8.5)) + (1 << 20)


def converter_config(config: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameters the pinned ``convert_hf_to_gguf.py`` indexes under their transformers 4 names and does not
    find in what transformers 5 loads from ``config`` (config.json), or finds with a value transformers' model code
    does not use, each as transformers reads it; empty when the script finds what it needs.
    :data:`CONVERT_WORKER` gives them to the script (they replace what it loads).

    * GPT-NeoX (``conversion/gptneox.py``): ``rotary_pct``. GPTNeoXConfig moves it into
      ``rope_parameters.partial_rotary_factor`` as it loads, whichever way config.json spells it (Pythia's
      ``rotary_pct``, transformers 5's ``rope_parameters``), default 0.25 as GPTNeoXConfig's.
    * GPT-2 (``conversion/gpt2.py``): ``n_ctx``, which transformers 5's ``save_pretrained`` no longer writes;
      its value is ``n_positions``, as GPT2Config reads it.
    * Falcon (``conversion/falcon.py``): ``num_kv_heads`` 1 for a multi-query model of the old decoder
      (``multi_query`` and not ``new_decoder_architecture``, as Falcon-7B): FalconConfig fills ``num_kv_heads``
      with the head count, and FalconAttention uses one key/value head there.
    * DeepSeek-V3 (``conversion/deepseek.py``, ``conversion/base.py``): ``scoring_func`` "sigmoid" where config.json
      has none. DeepseekV3TopkRouter always gates the experts with a sigmoid, and transformers 5's
      DeepseekV3Config neither has nor writes the key (DeepSeek's own config.json spells it out); without it the
      script writes no gating function and llama.cpp's deepseek2 takes a softmax: the GGUF loads and runs a
      different model (a tiny random one with a routed layer: F32 KLD 0.49 against transformers, 3.1e-5 with it).

    Without them the script stops on ``KeyError: 'rotary_pct'`` / ``'n_ctx'``, or on a reshape of Falcon's fused
    query/key/value weight, for models it supports, or (DeepSeek-V3) silently converts another model."""
    model_type = config.get("model_type")
    if model_type == "gpt_neox":
        rope = config.get("rope_parameters") or {}
        return {"rotary_pct": config.get("rotary_pct", rope.get("partial_rotary_factor", 0.25))}
    if model_type == "gpt2" and "n_ctx" not in config and "n_positions" in config:
        return {"n_ctx": config["n_positions"]}
    if model_type == "falcon" and config.get("multi_query", True) and not config.get("new_decoder_architecture"):
        return {"num_kv_heads": 1}  # FalconConfig's defaults: multi_query true, new_decoder_architecture false
    if model_type == "deepseek_v3" and "scoring_func" not in config:
        return {"scoring_func": "sigmoid"}
    return {}


def llama_cpp_divergences(config: dict[str, Any]) -> list[str]:
    """What in ``config`` (config.json) the pinned llama.cpp runs differently from transformers, where no GGUF key
    can say otherwise: the GGUF of such a checkpoint is a faithful llama.cpp model of another one, and its KLD
    against transformers shows it even at F32 (each measured on a tiny random checkpoint; README). Recorded in
    each GGUF variant's lineage (``parameters.llama_cpp_divergences``) and said with the run's results.

    * Qwen3-MoE with ``norm_topk_prob`` false (Qwen3MoeConfig's default; Qwen's releases say true): llama.cpp's
      qwen3moe always renormalises the chosen experts' weights (F32 KLD 0.032, against 1.5e-5 with true).
    * Gemma 3 with ``query_pre_attn_scalar`` not ``head_dim`` (both default 256; Google's sizes have them equal
      but the 27B, 62 layers, which llama.cpp special-cases): llama.cpp scales queries by 1/√head_dim (0.047 vs
      2.7e-7).
    * gpt-oss: llama.cpp's YaRN rounds the correction range where ``truncate`` is false (as gpt-oss's released
      config says), and its SwiGLU limit is 7.0 whatever ``swiglu_limit`` says (0.108 and 2.77 on a tiny one).
    """
    text = config.get("text_config")
    cfg = text if isinstance(text, dict) else config
    model_type = cfg.get("model_type") or config.get("model_type")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    out: list[str] = []
    if model_type == "qwen3_moe" and not cfg.get("norm_topk_prob", False):
        out.append("llama.cpp's qwen3moe always renormalises the chosen experts' routing weights; this config says "
                   "norm_topk_prob false, so the GGUF runs another model (its KLD against transformers shows it)")
    if model_type in ("gemma3", "gemma3_text") and cfg.get("num_hidden_layers") != 62:
        scalar, head = cfg.get("query_pre_attn_scalar", 256), cfg.get("head_dim", 256)
        if scalar != head:
            out.append(f"llama.cpp's gemma3 scales queries by 1/sqrt(head_dim {head}); this config says "
                       f"query_pre_attn_scalar {scalar}, so the GGUF runs another model (its KLD against "
                       "transformers shows it)")
    if model_type == "gpt_oss":
        if isinstance(rope, dict) and rope.get("truncate") is False:
            out.append("llama.cpp's YaRN rounds the correction range, where this config says truncate false "
                       "(vllm-project/vllm#27722 is the same mismatch in vLLM); the KLD against transformers shows it")
        if cfg.get("swiglu_limit", 7.0) != 7.0:
            out.append(f"llama.cpp's gpt-oss clamps the SwiGLU at 7.0; this config says swiglu_limit "
                       f"{cfg['swiglu_limit']}")
    return out


#: Tensors of a GPT-2 checkpoint that are no weights: GPT2Attention's causal-mask buffers ``h.N.attn.bias`` and
#: ``h.N.attn.masked_bias``, which older transformers saved (the Hub's GPT-2 holds them, inferred from its file's
#: size, not read here) and transformers ignores as it loads; the pinned converter stops on them
#: (``Can not map tensor 'h.0.attn.bias'``).
GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")


def converter_overrides(ckpt: Checkpoint) -> dict[str, Any]:
    """What the pinned ``convert_hf_to_gguf.py`` must be told to read ``ckpt`` as transformers does: ``hparams``
    (:func:`converter_config`) and ``skip_suffixes``, names of tensors transformers does not load
    (:data:`GPT2_BUFFERS`); empty when it reads the checkpoint right as it is. :data:`CONVERT_WORKER` applies
    them."""
    out: dict[str, Any] = {}
    if hparams := converter_config(ckpt.config):
        out["hparams"] = hparams
    if ckpt.config.get("model_type") == "gpt2" and any(n.endswith(GPT2_BUFFERS) for n in ckpt.tensors):
        out["skip_suffixes"] = list(GPT2_BUFFERS)
    return out


def _conversion_error(stderr: str, how: str, log: Path | None, ckpt: Checkpoint) -> Exception:
    if "No space left on device" in stderr:
        return DiskFullError(log.parent if log else ckpt.path, needed=int(ckpt.n_params * 2))
    if "pre-tokenizer was not recognized" in stderr or "BPE pre-tokenizer" in stderr:
        return TokenizerUnsupportedError(
            f"llama.cpp's converter does not recognise the BPE pre-tokenizer of {ckpt.path}: it cannot "
            "guarantee the GGUF tokenizes like the HF tokenizer, so it refused",
            hint="this tokenizer needs support in llama.cpp's convert_hf_to_gguf_update.py; "
                 "use a checkpoint with a known tokenizer (SentencePiece or a recognised BPE)")
    if "not supported" in stderr and "Architecture" in stderr:
        return UnsupportedArchitectureError(f"llama.cpp's converter does not support {ckpt.architecture}",
                                            supported=[])
    return ConversionError(f"convert_hf_to_gguf.py {how} on {ckpt.path}", stderr_tail=stderr,
                           hint=f"see the full log {log}")


def inspect_gguf(path: Path) -> dict[str, Any]:
    """Architecture, file type, tensor count and parameter count of a GGUF file (from its header). Raises
    InvalidArtifactError for a truncated or corrupt file."""
    return inspect_parts([path])


def _base_info(record: Path, base: Path) -> dict[str, Any]:
    """The base's inspection, as recorded beside it when it was converted (read again if the record is not one)."""
    try:
        info = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        info = None
    if isinstance(info, dict) and info.get("size") == base.stat().st_size and "tensor_count" in info:
        return info
    return inspect_gguf(base)


def _check_output(path: Path, info: dict[str, Any], spec: GGUFSpec, base: dict[str, Any]) -> None:
    problems = []
    if info["architecture"] != base["architecture"]:
        problems.append(f"architecture {info['architecture']!r} (base has {base['architecture']!r})")
    if info["file_type"] != spec.file_type:
        problems.append(f"file type {info['file_type']} (expected {spec.file_type} = {spec.type})")
    if info["tensor_count"] != base["tensor_count"]:
        problems.append(f"{info['tensor_count']} tensors (base has {base['tensor_count']})")
    if problems:
        raise ConversionError(f"{path.name} failed its GGUF check: " + "; ".join(problems),
                              hint="the quantizer wrote an inconsistent file; report it with the logs")


def staging_dir(root: Path, name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}.", dir=root))


__all__ = ["GGUF_BASE_TYPES", "GGUFConverter", "GGUFOptions", "ImatrixRequest", "inspect_gguf"]
