"""What every ``quantyard`` command uses: the Typer app, the shared options, settings, the mapping of
errors to exit codes, and the running and printing of plans (convert, demo, orchestrate).

Exit codes: 0 success; 1 a check failed (validate, verify); 2 bad usage or bad input
(typed errors from pipeline.errors); 3 a tool or engine failed; 4 an internal error.

This module imports no command module; the command modules import it (see ``pipeline/cli/__init__.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import ValidationError

from pipeline.errors import EXIT_ENGINE, EXIT_INTERNAL, EXIT_USAGE, ConfigError, InvalidSpecError, QuantyardError

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
        from rich.markup import escape

        from pipeline.render import err_console, print_json

        try:
            try:
                return fn(*args, **kwargs)
            except ValidationError as exc:  # input a model rejected (a flag out of range…): bad input, exit 2
                raise InvalidSpecError(f"invalid input: {validation_problems(exc)}",
                                       hint="see --help for the values each option accepts") from exc
        except QuantyardError as exc:
            if kwargs.get("as_json"):
                print_json(exc.to_dict())
            said = exc.message + (f" ({exc.cause})" if exc.cause else "")
            err_console.print(f"[bold red]error[/] ({type(exc).__name__}): {escape(said)}")
            if exc.hint:
                err_console.print(f"  [yellow]→[/] {escape(exc.hint)}")
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


def validation_problems(exc: ValidationError) -> str:
    """A pydantic ValidationError in one line: ``field: message`` for each problem."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors())


def flag_groups(order: Sequence[str]) -> Callable[[F], F]:
    """Let a command take its parameters as a few frozen dataclasses of Typer parameters ("flag groups").

    Every parameter of the decorated command is annotated with a dataclass whose fields are annotated
    like plain Typer parameters (``Annotated[..., typer.Option(...)] = default``). Typer sees the fields
    as one flat signature, in ``order`` (the order ``--help`` lists them); the command is called with
    one instance per group. ``order`` must name every field exactly once.
    """

    def decorate(fn: F) -> F:
        groups: dict[str, Any] = {name: cls for name, cls in typing.get_type_hints(fn).items() if name != "return"}
        owner: dict[str, str] = {}  # flag -> the command parameter (group) it belongs to
        params: dict[str, inspect.Parameter] = {}
        for group, cls in groups.items():
            hints = typing.get_type_hints(cls, include_extras=True)
            for field in dataclasses.fields(cls):
                if field.name in owner:
                    raise TypeError(f"{fn.__name__}: flag {field.name!r} is in two groups")
                default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
                owner[field.name] = group
                params[field.name] = inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                                       annotation=hints[field.name])
        if sorted(order) != sorted(owner):
            raise TypeError(f"{fn.__name__}: the flag order names {sorted(set(order) ^ set(owner))} wrongly")

        @functools.wraps(fn)
        def wrapper(**flags: Any) -> Any:
            values: dict[str, dict[str, Any]] = {group: {} for group in groups}
            for name, value in flags.items():
                values[owner[name]][name] = value
            return fn(**{group: groups[group](**kwargs) for group, kwargs in values.items()})

        wrapper.__signature__ = inspect.Signature([params[name] for name in order])  # type: ignore[attr-defined]
        wrapper.__annotations__ = {name: params[name].annotation for name in order}
        return wrapper  # type: ignore[return-value]

    return decorate


# -- running and printing plans (convert, convert --recipe, demo, orchestrate) ----------------------------


def run_plan(plan: Any, cfg: Any, as_json: bool) -> None:
    from pipeline.render import console, print_json, progress, results_table, usage_table
    from pipeline.shown import table_rows

    prefect_defaults()
    from flows.reuse import convert

    with progress(not as_json):
        report = convert(plan, cfg)  # a finished plan's re-run: from the stage ledger, without starting Prefect
    if as_json:
        print_json(report.model_dump(mode="json"))
    else:
        ref = report.reference or {}
        ws_id = str((report.window_set or {}).get("id", ""))[:12]
        caption = (f"source {report.source['identity'][:40]} · window set {ws_id}"
                   f" · reference PPL {ref.get('ppl', float('nan')):.4f} ({ref.get('engine_version', '—')})"
                   if report.reference else None)
        floor = report.noise_floor
        if caption and floor:
            caption += "\n" + floor_line(floor)
        console.print(results_table(f"{report.model}  ({report.wall_s:.1f} s)", table_rows(report.variants, floor),
                                    caption))
        if report.ledger_only:
            console.print("every stage reused from the stage ledger: decided without starting Prefect")
        if report.eval_schedule and report.eval_schedule["evaluations"] > 1:
            console.print(f"evaluations: {report.eval_schedule['reason']}")
        note = _source_note(report.source)
        if note:
            console.print(f"[yellow]note[/]: {note}")
        from rich.markup import escape

        for said, names in _variant_notes(report.variants).items():
            console.print(f"[yellow]note[/] ({', '.join(names)}): {escape(said)}")
        for v in report.variants:
            if v.error or v.eval_error:
                console.print(f"[red]{v.variant}[/]: {escape(v.error or v.eval_error or '')}")
        for said in (report.preflight or {}).get("notes", []):
            console.print(f"[yellow]note[/]: {escape(said)}")
        usage = usage_table(report.stages)
        if usage is not None:
            console.print(usage)
        for d in report.disk_used:
            console.print(f"disk: {escape(d['describe'])}")
    if any(v.status == "failed" for v in report.variants) or any(v.eval_status == "failed" for v in report.variants):
        raise typer.Exit(EXIT_ENGINE)
    if report.refused:  # the rest ran; what the pre-flight refused did not (flows/preflight.py)
        raise typer.Exit(EXIT_USAGE)


def floor_line(floor: dict[str, Any]) -> str:
    """The noise floor as a caption line: its KLD and interval and what measured it, or why there is none."""
    if floor.get("kld_mean") is None:
        return f"noise floor: {floor.get('reason') or 'not measured'}"
    lo, hi = floor.get("kld_ci95_low"), floor.get("kld_ci95_high")
    ci = f" [95 % CI {lo:.3g}–{hi:.3g}]" if lo is not None and hi is not None else ""
    return (f"noise floor: KLD {floor['kld_mean']:.3g}{ci} ({floor.get('reason')}; "
            f"{floor.get('engine_version')}): a KLD marked ≃ is within it")


def _variant_notes(variants: list[Any]) -> dict[str, list[str]]:
    """Each variant note once, with the variants it applies to."""
    out: dict[str, list[str]] = {}
    for v in variants:
        for said in v.notes:
            out.setdefault(said, []).append(v.variant)
    return out


def _source_note(source: dict[str, Any]) -> str | None:
    """What a reader of the numbers must know about the source (the real checkpoint's Q4_1 origin)."""
    from pipeline.real_model import provenance

    prov = provenance(Path(str(source.get("path") or ""))) if source.get("path") else None
    return str(prov["weights"]["note"]) if prov else None


def recipe_plans(path: Path, source: str | None = None) -> tuple[Any, list[Any]]:
    """A recipe and its plans; ``source`` (the positional SOURCE of ``convert``) replaces a one-source recipe's."""
    from pipeline.recipe import load_recipe_file

    recipe, plans = load_recipe_file(path)
    if source is not None:
        if len(plans) != 1:
            raise ConfigError(f"SOURCE {source} was given but the recipe {path} has {len(plans)} sources",
                              hint="leave SOURCE out, or use a one-source recipe")
        # Only the location changes: the entry's revision, allow_pickle and trust_remote_code are kept.
        plans = [plans[0].model_copy(update={"source": plans[0].source.model_copy(update={"source": source})})]
    return recipe, plans


def print_runs(runs: list[Any], as_json: bool, stages: bool = False) -> None:
    """Results and policy verdicts of recipe runs; exit 3 if a build or evaluation failed or a verdict did."""
    from pipeline.render import console, print_json, results_table
    from pipeline.shown import table_rows

    if as_json:
        print_json([r.model_dump(mode="json") for r in runs])
    else:
        for run in runs:
            report = run.report
            if stages:
                console.print(stage_table(report.stages))
            console.print(results_table(f"{report.model}  ({report.wall_s:.1f} s)", table_rows(report.variants)))
            for v in run.verdicts:
                mark = "[green]pass[/]" if v.passed else "[red]fail[/]"
                note = " → validated" if v.promoted else ""
                console.print(f"policy {v.variant}: {mark}{note} {'; '.join(v.problems)}")
    failed = any(not r.report.ok or any(v.eval_status == "failed" for v in r.report.variants) for r in runs)
    if failed or any(not v.passed for r in runs for v in r.verdicts):
        raise typer.Exit(EXIT_ENGINE)


def stage_table(stages: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table("stage", "pool", "status", "key", "work pool", "work s", "flow run", header_style="bold")
    for s in stages:
        work = s.get("work_s")
        table.add_row(s["stage"], s["pool"], s["status"], str(s["key"])[:16], s.get("work_pool") or "—",
                      f"{work:.2f}" if isinstance(work, float) else "—", str(s.get("flow_run_id") or "—")[:8])
    return table
