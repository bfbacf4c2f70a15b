"""``quantyard validate``: the CI gate for one quant (exit 0 pass, 1 a check failed, 2 bad input)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli.common import JsonOpt, RegistryOpt, handle_errors, prefect_defaults, settings
from pipeline.errors import EXIT_CHECK_FAILED


@handle_errors
def validate(
    target: Annotated[str, typer.Argument(help="MODEL/VARIANT[@VERSION|@ALIAS], or a .gguf file, AWQ or EXL2 folder.")],
    policy: Annotated[Path | None, typer.Option(help="YAML policy (quality limits per quant class, speed, serving "
                                                "SLO).")] = None,
    baseline: Annotated[str | None, typer.Option(help="Registry reference to compare speed against.")] = None,
    source: Annotated[str | None, typer.Option(help="Source checkpoint of a plain file target (folder or hub id).")]
    = None,
    junit: Annotated[Path | None, typer.Option(help="Write a JUnit XML report here (one test case per check).")]
    = None,
    reproduce: Annotated[bool, typer.Option(help="Rebuild from the recorded lineage and compare sha256.")] = False,
    promote: Annotated[bool, typer.Option(help="On a passing registry target, move candidate → validated.")] = False,
    max_windows: Annotated[int | None, typer.Option(help="Evaluate at most this many windows.")] = None,
    window: Annotated[int | None, typer.Option(help="Window length in tokens (default: as the registered "
                                               "evaluation of a registry target, else 512).")] = None,
    stride: Annotated[int | None, typer.Option(help="Window stride in tokens (default: as --window).")] = None,
    score_from: Annotated[int | None, typer.Option(help="First scored position of each window (257 with "
                                                   "--window 512: llama-perplexity's positions).")] = None,
    registry: RegistryOpt = None,
    threads: Annotated[int | None, typer.Option()] = None,
    as_json: JsonOpt = False,
) -> None:
    """Gate a quant on integrity, format, loadability, tokenizer parity, quality, speed, serving and reproducibility."""
    from rich.table import Table

    from flows.validate import ValidateOptions
    from flows.validate import promote as do_promote
    from flows.validate import validate as run_validate
    from pipeline.checks import write_junit
    from pipeline.plan import EvalSpec, SpeedSpec
    from pipeline.policy import load_policy
    from pipeline.render import console, print_json

    prefect_defaults()
    cfg = settings(registry, threads=threads)
    given = {k: v for k, v in {"max_windows": max_windows, "window": window, "stride": stride,
                               "score_from": score_from}.items() if v is not None}
    if window is not None and stride is None:
        given["stride"] = window
    opts = ValidateOptions(policy=load_policy(policy), source=source, baseline=baseline, reproduce=reproduce,
                           eval=EvalSpec.model_validate({**given, "speed": SpeedSpec(enabled=False)})
                           if given else None)
    report = run_validate(target, cfg, opts)
    state = do_promote(report, target, cfg) if promote else None
    if junit is not None:
        write_junit([report], junit)
    if as_json:
        print_json({**report.model_dump(mode="json"), "passed": report.passed, "state": state})
    else:
        table = Table("check", "result", "detail", title=f"validate {report.target}", header_style="bold")
        colour = {"pass": "green", "fail": "red", "skip": "yellow"}
        for c in report.checks:
            table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.message)
        console.print(table)
        verdict = "[green]PASSED[/]" if report.passed else "[red]FAILED[/]"
        console.print(verdict + (f" · state: {state}" if state else ""))
    if not report.passed:
        raise typer.Exit(EXIT_CHECK_FAILED)


def register(app: typer.Typer) -> None:
    app.command()(validate)
