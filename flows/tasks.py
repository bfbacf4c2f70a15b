"""Prefect tasks: thin wrappers over flows.steps, one per stage. Caching across runs is done by the
registry (build keys, source artifacts), so Prefect's own cache is off for these tasks."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from flows import steps

# task(**options)(fn) is what task(fn, **options) does at run time; only this form is in Prefect's typed
# overloads, so each Task keeps its step's parameter and return types.
resolve_task = task(name="resolve-source", cache_policy=NONE)(steps.resolve)
prepare_task = task(name="prepare-format", cache_policy=NONE)(steps.prepare_format)
build_task = task(name="build-variant", cache_policy=NONE, task_run_name="build-{spec.name}")(steps.build_variant)
register_task = task(name="register-version", cache_policy=NONE, task_run_name="register-{spec.name}")(steps.register)
window_set_task = task(name="window-set", cache_policy=NONE)(steps.ensure_window_set)
reference_task = task(name="reference", cache_policy=NONE)(steps.ensure_reference)
evaluate_task = task(name="evaluate", cache_policy=NONE, task_run_name="evaluate-{ref}")(steps.evaluate_version)
