"""``quantyard deploy`` and ``quantyard watch``: register Quantyard's flows with a Prefect server.

* Every stage flow (flows/stages.py) is deployed once per logical pool, ``quantyard-STAGE/cpu`` and
  ``quantyard-STAGE/gpu``, on the work pools named by ``--work-pool-cpu`` / ``--work-pool-gpu``; a run's
  placement (pipeline/recipe.py) picks which one each stage uses.
* A pool with a concurrency setting gets a Prefect global concurrency limit ``quantyard-cpu`` /
  ``quantyard-gpu``; that pool's heavy stages (prepare, build, reference, evaluate) hold one slot while
  they work. The limit is server-wide: ``--gpu-concurrency 1`` means one heavy GPU job at a time across
  the pool (one GPU machine); with N GPU machines use N, and start each worker with ``--limit 1``.
* ``quantyard-orchestrate/default`` runs the orchestrating flow itself on the CPU pool (for the UI and
  for automations); ``quantyard-watch/RECIPE`` is the scheduled watch of one recipe.

Deployments point at importable modules (``flows.stages.build_stage``): a worker needs a checkout of the
same Quantyard commit installed (``pip install -e .``), since tool environments and stage keys read
``requirements/`` from it.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from flows.stages import HEAVY_STAGES, STAGE_FLOWS
from pipeline.errors import ConfigError

LOGICAL_POOLS = ("cpu", "gpu")


class PoolConfig(BaseModel):
    """One logical pool: the Prefect work pool that serves it and its concurrency (None: unlimited)."""

    work_pool: str
    concurrency: int | None = None

    def slot(self, logical: str) -> str | None:
        """The concurrency limit this pool's heavy stages hold a slot of (None: no limit)."""
        return limit_name(logical) if self.concurrency else None


def limit_name(logical: str) -> str:
    return f"quantyard-{logical}"


def ensure_pools(pools: dict[str, PoolConfig], create: bool = True) -> list[str]:
    """Make sure each work pool exists (created as a ``process`` pool when missing and ``create``); set or
    remove each pool's global concurrency limit. Returns what was created or changed, for the CLI.

    Raises:
        ConfigError: a work pool is missing and ``create`` is off, or the server is unreachable.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    done = []
    with get_client(sync_client=True) as client:
        for logical, cfg in pools.items():
            try:
                client.read_work_pool(cfg.work_pool)
            except ObjectNotFound:
                if not create:
                    raise ConfigError(f"work pool {cfg.work_pool!r} ({logical}) does not exist on the Prefect server",
                                      hint=f"prefect work-pool create {cfg.work_pool} --type process") from None
                client.create_work_pool(WorkPoolCreate(name=cfg.work_pool, type="process"))
                done.append(f"created work pool {cfg.work_pool} (process)")
            name = limit_name(logical)
            if cfg.concurrency:
                client.upsert_global_concurrency_limit_by_name(name, cfg.concurrency)
                done.append(f"concurrency limit {name} = {cfg.concurrency}")
            else:
                try:
                    client.delete_global_concurrency_limit_by_name(name)
                    done.append(f"removed concurrency limit {name}")
                except ObjectNotFound:
                    pass
    return done


def _apply(flow_obj: Any, name: str, work_pool: str, parameters: dict[str, Any], **kw: Any) -> str:
    from prefect.types.entrypoint import EntrypointType

    deployment = flow_obj.to_deployment(name=name, work_pool_name=work_pool, parameters=parameters,
                                        entrypoint_type=EntrypointType.MODULE_PATH, tags=["quantyard"], **kw)
    deployment.apply()
    return f"{flow_obj.name}/{name}"


def deploy_stages(pools: dict[str, PoolConfig]) -> list[str]:
    """Deploy every stage flow on every logical pool and the orchestrator on the CPU pool; returns the names."""
    from flows.orchestrate import orchestrate_flow

    names = []
    for stage, flow_obj in STAGE_FLOWS.items():
        for logical, cfg in pools.items():
            slot = cfg.slot(logical) if stage in HEAVY_STAGES else None
            names.append(_apply(flow_obj, logical, cfg.work_pool, {"slot": slot},
                                description=f"Quantyard stage {stage} on the {logical} pool"))
    names.append(_apply(orchestrate_flow, "default", pools["cpu"].work_pool, {},
                        description="Runs a plan's stages on the cpu/gpu pools"))
    return names


def deploy_watch(recipe: dict[str, Any], base_dir: Path, name: str, *, work_pool: str, interval_s: float | None,
                 cron: str | None, registry: str | None, blobs: str | None, mode: str) -> str:
    """Deploy the scheduled watch of one recipe (its content travels as a parameter).

    Raises:
        ConfigError: neither or both of ``interval_s`` and ``cron`` are given.
    """
    from flows.watch import watch_flow

    if (interval_s is None) == (cron is None):
        raise ConfigError("a watch needs exactly one schedule", hint="pass --interval SECONDS or --cron 'EXPR'")
    schedule: dict[str, Any] = {"interval": timedelta(seconds=interval_s)} if interval_s else {"cron": cron}
    params = {"recipe": recipe, "base_dir": str(base_dir), "registry": registry, "blobs": blobs, "mode": mode}
    return _apply(watch_flow, name, work_pool, params, description=f"Quantyard watch of recipe {name}", **schedule)
