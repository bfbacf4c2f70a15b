"""Watching sources: rebuild a recipe when its source moved on.

Each tick pins every source of the recipe — a hub revision to the commit it points at now (one API call),
a folder to its content hash — and compares that with what the registry last built: the source of the
latest version of each of the recipe's variants. When any variant's latest version comes from another
commit (or does not exist yet), the recipe runs for the new commit; otherwise nothing happens. This is
what ggml-org/convert keeps in its ``.src_sha`` file, kept here by the registry itself, so every
machine and every run agrees on it.

``quantyard watch RECIPE.yaml`` deploys :func:`watch_flow` with a schedule (flows/deployments.py);
``quantyard watch RECIPE.yaml --once`` runs one tick here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, Field

from flows.ledger import pin_source
from flows.recipes import Mode, RecipeRun, run_plan
from flows.steps import default_model_name, resolve_backends
from pipeline.config import Settings
from pipeline.errors import NotFoundError
from pipeline.plan import Plan
from pipeline.recipe import parse_recipe
from registry import open_registry
from registry.store import Registry


class Tick(BaseModel):
    """What one watch tick found for one source, and the run it started (if any)."""

    source: str
    model: str
    identity: str
    changed: bool
    reasons: list[str] = Field(default_factory=list)
    run: RecipeRun | None = None


def stale_variants(reg: Registry, model: str, plan: Plan, identity: str,
                   concrete: Mapping[str, tuple[str, ...]] | None = None) -> list[str]:
    """The recipe's variants whose latest version was not built from ``identity`` (with why). ``concrete``
    maps a spec's name to the names it may be registered under once its backend is resolved."""
    concrete = concrete or {}
    stale = []
    for spec in plan.variants:
        # A spec whose backend is open is registered under its concrete name (EXL2-4.0bpw-ref on a machine
        # without ExLlamaV2): look for either name.
        names = dict.fromkeys([spec.name, *concrete.get(spec.name, ())])
        version = None
        for name in names:
            try:
                version = reg.get_version(f"{model}/{name}")
                break
            except NotFoundError:
                continue
        if version is None:
            stale.append(f"{spec.name}: not built yet")
            continue
        built_from = version.source["identity"]
        if built_from != identity:
            stale.append(f"{spec.name}: latest {version.ref} was built from {built_from}")
    return stale


def check_source(plan: Plan, settings: Settings) -> tuple[Tick, Plan]:
    """Pin ``plan``'s source now and compare it with the registry; returns the tick and the pinned plan."""
    identity, pinned, source = pin_source(plan.source, settings)
    model = plan.model_name or default_model_name(source)
    concrete = {spec.name: (resolve_backends(plan.model_copy(update={"variants": (spec,)}), settings).variants[0].name,)
                for spec in plan.variants}
    reasons = stale_variants(open_registry(settings), model, plan, identity, concrete)
    tick = Tick(source=plan.source.source, model=model, identity=identity, changed=bool(reasons), reasons=reasons)
    return tick, plan.model_copy(update={"source": pinned, "model_name": model})


def watch_once(recipe: dict[str, Any], base_dir: Path, settings: Settings, mode: Mode) -> list[Tick]:
    """One tick over every source of ``recipe``: run it for each source that changed."""
    parsed, plans = parse_recipe(recipe, base_dir)
    ticks = []
    for plan in plans:
        tick, pinned = check_source(plan, settings)
        if tick.changed:
            tick.run = run_plan(pinned, parsed, settings, mode)
        ticks.append(tick)
    return ticks


@flow(name="quantyard-watch", log_prints=True)
def watch_flow(recipe: dict[str, Any], base_dir: str, registry: str | None = None, blobs: str | None = None,
               mode: Mode = "distributed") -> list[Tick]:
    """A scheduled tick (see the module docstring). ``recipe`` is the recipe's content; its relative paths
    resolve against ``base_dir``."""
    logger = get_run_logger()
    settings = Settings(**{k: v for k, v in (("registry", registry), ("blobs", blobs)) if v})  # type: ignore[arg-type]
    ticks = watch_once(recipe, Path(base_dir), settings, mode)
    for tick in ticks:
        if tick.changed:
            assert tick.run is not None
            logger.info("%s is at %s: rebuilt (%s); %s", tick.source, tick.identity, "; ".join(tick.reasons),
                        ", ".join(f"{v.variant}={v.status}" for v in tick.run.report.variants))
        else:
            logger.info("%s is still at %s: every variant is built from it, nothing to do", tick.source,
                        tick.identity)
    return ticks
