"""Running a recipe (pipeline/recipe.py): every source's plan, in one process (``flows.reuse.convert``) or as
stages on the work pools (``orchestrate_flow``), then the recipe's quality policy on what was evaluated."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from pipeline.config import Settings
from pipeline.plan import Plan
from pipeline.policy import quant_class
from pipeline.recipe import Recipe
from pipeline.results import ConvertReport
from registry import open_registry

Mode = Literal["embedded", "distributed", "local"]


class Verdict(BaseModel):
    """The recipe policy's judgement of one evaluated variant."""

    variant: str
    ref: str | None
    passed: bool
    problems: list[str] = Field(default_factory=list)
    promoted: bool = False


class RecipeRun(BaseModel):
    report: ConvertReport
    verdicts: list[Verdict] = Field(default_factory=list)


def run_plan(plan: Plan, recipe: Recipe, settings: Settings, mode: Mode) -> RecipeRun:
    """One source of a recipe: convert (embedded) or orchestrate (distributed / local stages), then judge."""
    if mode == "embedded":
        from flows.reuse import convert

        report = convert(plan, settings)  # a finished plan: from the stage ledger, without starting Prefect
    else:
        from flows.orchestrate import orchestrate_flow

        report = orchestrate_flow(plan, registry=settings.registry, blobs=settings.blobs,
                                  placement=recipe.placement, dispatch="local" if mode == "local" else "deployments")
    return RecipeRun(report=report, verdicts=judge(report, recipe, settings))


def judge(report: ConvertReport, recipe: Recipe, settings: Settings) -> list[Verdict]:
    """Check every evaluated variant against the recipe's policy; with ``promote``, move each passing new
    candidate to ``validated`` (audited). No policy in the recipe: no verdicts."""
    if recipe.policy is None:
        return []
    policy = recipe.policy.policy()
    reg = open_registry(settings)
    verdicts = []
    for out in report.variants:
        if not out.quality or out.ref is None:
            continue
        version = reg.get_version(out.ref)
        limits = policy.limits_for(out.variant, quant_class(out.format, version.spec), version.spec.get("type"))
        problems = limits.problems(out.quality)
        verdict = Verdict(variant=out.variant, ref=out.ref, passed=not problems, problems=problems)
        if verdict.passed and recipe.policy.promote and version.state == "candidate":
            reg.set_state(out.ref, "validated", note="recipe policy")
            verdict.promoted = True
        verdicts.append(verdict)
    return verdicts
