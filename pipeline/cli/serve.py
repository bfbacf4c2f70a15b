"""``quantyard serve-bench``: one registered variant behind its engine's OpenAI-compatible server, loaded by
GuideLLM at several numbers of concurrent users; the serving result is registered (flows/serving.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.cli.common import JsonOpt, RegistryOpt, handle_errors, settings
from pipeline.errors import InvalidSpecError


def parse_users(text: str | None) -> tuple[int, ...]:
    """``1,8,32,64`` → (1, 8, 32, 64).

    Raises:
        InvalidSpecError: not a comma-separated list of positive whole numbers.
    """
    if not text:
        return ()
    try:
        users = tuple(int(u) for u in text.split(",") if u.strip())
    except ValueError:
        users = ()
    if not users or min(users) < 1:
        raise InvalidSpecError(f"--users {text!r} is not a list of positive numbers", hint="e.g. --users 1,8,32,64")
    return users


@handle_errors
def serve_bench(
    target: Annotated[str, typer.Argument(help="MODEL/VARIANT[@VERSION|@ALIAS] in the registry.")],
    profile: Annotated[str, typer.Option(help="auto (the seed shape 512/256 at 1/8/32/64 users on a GPU, a "
                                         "CPU-scaled one on a CPU), seed, or cpu.")] = "auto",
    users: Annotated[str | None, typer.Option(help="Concurrent users per level, e.g. 1,8,32,64.")] = None,
    requests: Annotated[int | None, typer.Option(help="Measured requests per level.", min=1)] = None,
    prompt_tokens: Annotated[int | None, typer.Option(help="Prompt tokens per request.", min=8)] = None,
    output_tokens: Annotated[int | None, typer.Option(help="Generated tokens per request.", min=2)] = None,
    sweep: Annotated[bool, typer.Option(help="Add an open-loop Poisson sweep up to the SLO knee.")] = False,
    tensor_parallel: Annotated[int, typer.Option(help="The engine's tensor parallelism (GPUs).", min=1)] = 1,
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder for the load prompts (default: the "
                                                   "variant's own, else its source's).")] = None,
    registry: RegistryOpt = None,
    threads: Annotated[int | None, typer.Option()] = None,
    as_json: JsonOpt = False,
) -> None:
    """Serve TARGET on its engine's server (llama-server, vLLM, ExLlamaV2), load it with GuideLLM, and register
    the latency percentiles, throughput and memory measured."""
    from flows.serving import serve_version
    from flows.steps import scratch_dir
    from pipeline.plan import ServingSpec

    cfg = settings(registry, threads=threads)
    spec = ServingSpec(enabled=True, profile=profile, users=parse_users(users),  # type: ignore[arg-type]
                       requests=requests, prompt_tokens=prompt_tokens, output_tokens=output_tokens, sweep=sweep,
                       tensor_parallel=tensor_parallel, tokenizer=str(tokenizer) if tokenizer else None)
    with scratch_dir(cfg, "serve") as tmp:
        result = serve_version(cfg, target, spec, Path(tmp))
    _print(target, result.model_dump(mode="json"), as_json)


def _print(target: str, result: dict[str, Any], as_json: bool) -> None:
    from pipeline.render import console, print_json
    from pipeline.serving import ServingMetrics

    if as_json:
        print_json(result)
        return
    from rich.table import Table

    from pipeline.serving_summary import CPU_SCALED_PROFILE
    from pipeline.shown import CPU_SCALED, DENSE_KERNEL, dense_kernel

    m = ServingMetrics.model_validate(result["metrics"])
    p = m.profile
    marks = [mk for mk, on in ((CPU_SCALED, p.name == CPU_SCALED_PROFILE),
                               (DENSE_KERNEL, bool(dense_kernel(m.server.flags)))) if on]
    sym = "".join(mk.symbol for mk in marks)
    title = (f"{target} on {m.server.server}{sym} ({m.server.version}) · {p.name} profile, {p.prompt_tokens} "
             f"prompt / {p.output_tokens} output tokens ({p.tool})")
    table = Table("users / rate", "requests", "failed", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "ITL p99 ms",
                  "output tok/s", "peak RSS GB", title=title, header_style="bold")
    for lv in m.levels:
        load = str(lv.concurrency) if lv.mode == "concurrency" else f"{lv.rate:g}/s"
        table.add_row(load, str(lv.requests), str(lv.failed), _ms(lv.ttft_ms, "median"), _ms(lv.ttft_ms, "p99"),
                      _ms(lv.tpot_ms, "median"), _ms(lv.itl_ms, "p99"),
                      f"{lv.output_throughput:,.1f}" if lv.output_throughput else "—",
                      f"{lv.rss_peak_bytes / 1e9:.2f}" if lv.rss_peak_bytes else "—")
    console.print(table)
    for mk in marks:  # every latency and throughput above carries them (the title's marks)
        console.print(mk.line, markup=False)
    mem = m.memory
    kv = f", KV cache {mem.kv_cache_bytes / 1e6:,.0f} MB ({mem.kv_cache_source})" if mem.kv_cache_bytes else ""
    console.print(f"memory: weights {mem.weights_bytes / 1e9:.3f} GB, after load "
                  f"{(mem.rss_after_load_bytes or 0) / 1e9:.2f} GB RSS, peak {(mem.peak_bytes or 0) / 1e9:.2f} GB at "
                  f"context {mem.context} with {mem.concurrency} users{kv}")
    if p.note:
        console.print(f"[yellow]{p.note}[/]")
    if m.knee:
        console.print(f"knee: {m.knee}")


def _ms(p: Any, key: str) -> str:
    return "—" if p is None else f"{getattr(p, key):,.1f}"


def register(app: typer.Typer) -> None:
    app.command(name="serve-bench")(serve_bench)
