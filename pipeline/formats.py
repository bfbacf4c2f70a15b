"""The formats Quantyard builds: one typed line per format in :data:`FORMATS`.

Everything the rest of the code must know about a format and that is not its converter's own business
lives here: which engine evaluates it (and which stands in, which cross-checks), where it builds, which
tool environments and lock files pin it, how an engine loads it, how its folders announce themselves,
and how the registry shows and publishes it. Flows, the registry and the CLI read this table; none of
them keeps a table or an ``if fmt == ...`` branch of its own. The converter (``converters/<format>/``)
does the format's work; its import path is ``converter`` below.

Add a format: see converters/README.md (one package, one line here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, PlainSerializer, PlainValidator, SerializationInfo, WithJsonSchema

from pipeline.errors import InvalidSpecError, UnknownFormatError
from pipeline.specs import AWQSpec, Engine, EXL2Spec, GGUFSpec, QuantFormat

Pool = Literal["cpu", "gpu"]

LLAMA_CPP_LOCK = "requirements/llama-cpp.lock"


@dataclass(frozen=True)
class Launcher:
    """How to serve a pulled copy on the format's engine. ``template`` names ``{dest}`` (the folder it was
    pulled to), ``{first_file}`` (the version's first file in name order with ``suffix``), ``{path}``
    (``dest/first_file``) and ``{variant}``; the registry quotes each value for the shell."""

    label: str
    template: str
    suffix: str | None = None  # the launcher needs a file with this suffix (none: no launch command)


@dataclass(frozen=True)
class HubLayout:
    """How a publication to the Hugging Face Hub lays the format out."""

    one_variant_per_repo: bool = False  # a repo holds one checkpoint folder (AWQ)
    revision_per_variant: bool = False  # each variant on its own branch named by its bits per weight (EXL2)
    split_large_files: bool = False  # files over the split size go up as llama-gguf-split parts (GGUF)


@dataclass(frozen=True)
class FormatInfo:
    """One format, as the code outside its converter sees it."""

    format: QuantFormat
    label: str  # as shown to people: GGUF, AWQ, EXL2
    spec: type[BaseModel]  # its variant spec: a frozen model with ``format``, ``name`` and ``quant_class``
    converter: str  # "module:Class" of its Converter (imported only when used)
    engine: Engine  # evaluates it by default
    fallback_engine: Engine | None = None  # stands in, labelled, where the engine cannot run here
    fallback_note: str = ""  # what the stand-in is, for the legend of every table that shows its numbers
    cross_check_engine: Engine | None = None  # a second, independent engine run on the same files
    pool: Pool = "gpu"  # where its conversion runs in a distributed run, unless the recipe says otherwise
    tool_envs: tuple[str, ...] = ()  # managed tool environments (pipeline/envs.py) its converter runs
    tool_locks: tuple[str, ...] = ()  # lock files (relative to the repository) pinning tools that are not envs
    single_file: bool = False  # an engine loads its (first) file, not the folder
    suffix: str | None = None  # its files' suffix, for single-file formats
    magic: bytes | None = None  # the first bytes of its files, for single-file formats
    quant_methods: tuple[str, ...] = ()  # config.json quantization_config.quant_method of its folders
    own_tokenizer: bool = False  # carries its own vocabulary (checked against the HF tokenizer), vs the HF files
    shared_prepared: tuple[str, ...] = ()  # files of its preparation that builds on other machines need
    plan_options: str | None = None  # the Plan field holding its plan-level options (lineage["options"])
    colour: str = "#7f7f7f"  # its markers in the registry's size-vs-quality chart
    library_name: str = ""  # the model card's library_name on the Hub
    #: What else lowers its conversion's memory, said in a pre-flight refusal (", or ..."; flows/preflight.py)
    lower_memory: str = ""
    launcher: Launcher | None = None
    hub: HubLayout = field(default_factory=HubLayout)


FORMATS: dict[QuantFormat, FormatInfo] = {
    QuantFormat.GGUF: FormatInfo(
        format=QuantFormat.GGUF, label="GGUF", spec=GGUFSpec, converter="converters.gguf.converter:GGUFConverter",
        engine=Engine.LLAMA_CPP, pool="cpu", tool_locks=(LLAMA_CPP_LOCK,), single_file=True, suffix=".gguf",
        magic=b"GGUF", own_tokenizer=True, shared_prepared=("base", "imatrix", "calibration"), plan_options="gguf",
        colour="#1f77b4", library_name="gguf",
        lower_memory=", or build fewer or smaller types (an evaluation holds a quantized type's repacked weights)",
        # a split GGUF is loaded through its first part; llama.cpp finds the others beside it
        launcher=Launcher("llama.cpp server", "llama-server -m {path} --port 8080", suffix=".gguf"),
        hub=HubLayout(split_large_files=True)),
    QuantFormat.AWQ: FormatInfo(
        format=QuantFormat.AWQ, label="AWQ", spec=AWQSpec, converter="converters.awq.converter:AWQConverter",
        engine=Engine.VLLM, fallback_engine=Engine.TRANSFORMERS, cross_check_engine=Engine.TRANSFORMERS,
        fallback_note="the AWQ folder decompressed by transformers (compressed-tensors) in fp32, not vLLM's "
                      "kernels; quality only, no speed",
        pool="gpu", tool_envs=("awq", "autoawq"), quant_methods=("awq", "compressed-tensors"), colour="#d62728",
        lower_memory=", or calibrate on fewer or shorter samples (--awq-calibration-samples, "
                     "--awq-calibration-seq-len)",
        library_name="transformers", launcher=Launcher("vLLM", "vllm serve {dest} --served-model-name {variant}"),
        hub=HubLayout(one_variant_per_repo=True)),
    QuantFormat.EXL2: FormatInfo(
        format=QuantFormat.EXL2, label="EXL2", spec=EXL2Spec, converter="converters.exl2.converter:EXL2Converter",
        engine=Engine.EXLLAMAV2, fallback_engine=Engine.EXL2_REFERENCE, pool="gpu", tool_envs=("exl2",),
        fallback_note="dequantized EXL2 weights in fp32 transformers, not ExLlamaV2's kernels; quality only, "
                      "no speed",
        quant_methods=("exl2",), colour="#2ca02c", library_name="exllamav2",
        lower_memory=", or use the exllamav2 backend on a CUDA GPU (--exl2-backend exllamav2), which works a layer "
                     "at a time",
        launcher=Launcher("TabbyAPI (ExLlamaV2), from its checkout",
                          "python main.py --model-dir . --model-name {dest}"),
        hub=HubLayout(revision_per_variant=True)),
}


def format_info(fmt: str) -> FormatInfo:
    """The table line of format ``fmt`` (a :class:`QuantFormat` or its value).

    Raises:
        UnknownFormatError: ``fmt`` is not a known format; the message lists the known ones.
    """
    info = FORMATS.get(fmt)  # type: ignore[call-overload]  # a QuantFormat is its str value
    if info is None:
        raise UnknownFormatError(f"unknown format {fmt!r}; known: {', '.join(known_formats())}",
                                 hint="choose one of the known formats (converters/README.md adds one)")
    return info


def known_formats() -> list[str]:
    return sorted(str(f) for f in FORMATS)


def parse_variant_spec(value: Any) -> Any:
    """A variant spec from its mapping (dispatched on ``format`` through :data:`FORMATS`), or an instance
    of a format's spec model as it is.

    Raises:
        UnknownFormatError: the mapping names no known format.
        InvalidSpecError: ``value`` is neither a mapping with a ``format`` nor a spec model.
    """
    if isinstance(value, BaseModel):
        info = format_info(str(getattr(value, "format", "")))
        if not isinstance(value, info.spec):
            raise InvalidSpecError(f"a {info.label} variant must be a {info.spec.__name__}, "
                                   f"got {type(value).__name__}")
        return value
    if not isinstance(value, dict) or "format" not in value:
        raise InvalidSpecError(f"a variant spec is a mapping with a 'format' key, got {value!r}",
                               hint=f"formats: {', '.join(known_formats())}")
    return format_info(str(value["format"])).spec.model_validate(value)


def _dump_spec(value: BaseModel, info: SerializationInfo) -> dict[str, Any]:
    return value.model_dump(mode=info.mode)


#: A variant of any format in :data:`FORMATS`: validated by that format's spec model.
VariantSpec = Annotated[
    Any, PlainValidator(parse_variant_spec), PlainSerializer(_dump_spec),
    WithJsonSchema({"type": "object", "properties": {"format": {"type": "string"}}, "required": ["format"]})]


__all__ = ["FORMATS", "FormatInfo", "HubLayout", "Launcher", "Pool", "VariantSpec", "format_info", "known_formats",
           "parse_variant_spec"]
