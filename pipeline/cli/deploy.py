"""Distributed commands: ``quantyard deploy``, ``quantyard orchestrate``, ``quantyard watch`` (see
flows/deployments.py, flows/orchestrate.py, flows/watch.py).

``deploy``, ``orchestrate`` and a scheduled ``watch`` talk to the Prefect server named by
``PREFECT_API_URL``; without one they stop with a clear error instead of starting a throw-away server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli.common import (
    JsonOpt,
    RegistryOpt,
    handle_errors,
    prefect_defaults,
    print_runs,
    recipe_plans,
    settings,
)
from pipeline.errors import ConfigError

RecipeArg = Annotated[Path, typer.Argument(help="Recipe YAML (source, formats, eval, policy, placement).")]
CpuPoolOpt = Annotated[str, typer.Option("--work-pool-cpu", help="Prefect work pool of the CPU stages.")]
GpuPoolOpt = Annotated[str, typer.Option("--work-pool-gpu", help="Prefect work pool of the GPU stages.")]


def server_url() -> str | None:
    """The Prefect API URL this process is configured for (PREFECT_API_URL or the Prefect profile), if any."""
    prefect_defaults()
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def require_server() -> str:
    """The Prefect API URL this process talks to.

    Raises:
        ConfigError: none is configured (Prefect would otherwise start a temporary server of its own).
    """
    url = server_url()
    if not url:
        raise ConfigError("no Prefect server is configured (PREFECT_API_URL is unset)",
                          hint="start one (prefect server start) and set PREFECT_API_URL=http://HOST:4200/api; "
                               "see docs/distributed.md")
    return str(url)


def registry_location(registry: str | None) -> str:
    """The registry as every worker must see it: a folder made absolute, URIs as they are."""
    cfg = settings(registry)
    location = str(cfg.registry)
    if "://" in location:
        return location
    return str(Path(location).expanduser().resolve())


@handle_errors
def deploy(
    work_pool_cpu: CpuPoolOpt = "cpu",
    work_pool_gpu: GpuPoolOpt = "gpu",
    cpu_concurrency: Annotated[int, typer.Option(help="Heavy CPU stages at a time on the CPU pool (0: no limit).")]
    = 0,
    gpu_concurrency: Annotated[int, typer.Option(help="Heavy GPU stages at a time on the GPU pool: one per GPU "
                                                 "(0: no limit).")] = 1,
    create_pools: Annotated[bool, typer.Option("--create-pools/--no-create-pools",
                                               help="Create missing work pools (type process).")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Register the stage deployments on the CPU and GPU work pools, with their concurrency limits."""
    from flows.deployments import PoolConfig, deploy_stages, ensure_pools
    from pipeline.render import console, print_json

    url = require_server()
    pools = {"cpu": PoolConfig(work_pool=work_pool_cpu, concurrency=cpu_concurrency or None),
             "gpu": PoolConfig(work_pool=work_pool_gpu, concurrency=gpu_concurrency or None)}
    changes = ensure_pools(pools, create=create_pools)
    names = deploy_stages(pools)
    if as_json:
        print_json({"server": url, "changes": changes, "deployments": names})
        return
    for line in changes:
        console.print(f"[green]✓[/] {line}")
    console.print(f"[green]✓[/] {len(names)} deployments on {url}: " + ", ".join(names))


@handle_errors
def orchestrate(
    recipe: RecipeArg,
    registry: RegistryOpt = None,
    local: Annotated[bool, typer.Option("--local", help="Run the stages in this process (no server or workers).")]
    = False,
    as_json: JsonOpt = False,
) -> None:
    """Run a recipe as stages on the work pools (see `quantyard deploy`); finished stages are reused."""
    from flows.recipes import run_plan

    if not local:
        require_server()
    prefect_defaults()
    parsed, plans = recipe_plans(recipe)
    cfg = settings(registry_location(registry))
    runs = [run_plan(plan, parsed, cfg, "local" if local else "distributed") for plan in plans]
    print_runs(runs, as_json, stages=True)


@handle_errors
def watch(
    recipe: RecipeArg,
    interval: Annotated[float | None, typer.Option(help="Check every this many seconds.")] = None,
    cron: Annotated[str | None, typer.Option(help="Check on this cron schedule instead, e.g. '0 * * * *'.")] = None,
    work_pool_cpu: CpuPoolOpt = "cpu",
    embedded: Annotated[bool, typer.Option("--embedded", help="Build in the watch's own process, not as stages.")]
    = False,
    once: Annotated[bool, typer.Option("--once", help="Check now, here, instead of deploying a schedule.")] = False,
    registry: RegistryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Deploy a scheduled watch: rebuild RECIPE whenever a source's commit (or a folder's content) changes."""
    import yaml

    from pipeline.recipe import load_recipe_file
    from pipeline.render import console, print_json

    load_recipe_file(recipe)  # fail now, not at the first scheduled run
    data = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    location = registry_location(registry)
    mode = "embedded" if embedded or (once and not server_url()) else "distributed"
    if once:
        prefect_defaults()
        from flows.watch import watch_once

        ticks = watch_once(data, recipe.resolve().parent, settings(location), mode)  # type: ignore[arg-type]
        if as_json:
            print_json([t.model_dump(mode="json") for t in ticks])
            return
        for t in ticks:
            console.print(f"{t.source}: {t.identity} — " + ("; ".join(t.reasons) + " → rebuilt" if t.changed
                                                            else "up to date"))
        return
    from flows.deployments import deploy_watch

    require_server()
    cfg = settings(location)
    name = deploy_watch(data, recipe.resolve().parent, recipe.stem, work_pool=work_pool_cpu,
                        interval_s=interval if interval is not None or cron else 3600.0, cron=cron,
                        registry=location, blobs=cfg.blobs, mode=mode)
    if as_json:
        print_json({"deployment": name, "interval_s": interval, "cron": cron, "mode": mode})
        return
    console.print(f"[green]✓[/] {name} checks {recipe} every {interval or 3600:g} s" if not cron
                  else f"[green]✓[/] {name} checks {recipe} on cron {cron!r}")


def register(app: typer.Typer) -> None:
    app.command()(deploy)
    app.command()(orchestrate)
    app.command()(watch)
