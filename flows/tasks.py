"""Prefect tasks: thin wrappers over flows.steps, one per stage. Caching across runs is done by the
registry (build keys, source artifacts), so Prefect's own cache is off for these tasks."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from flows import steps

resolve_task = task(steps.resolve, name="resolve-source", cache_policy=NONE)
prepare_task = task(steps.prepare_format, name="prepare-format", cache_policy=NONE)
build_task = task(steps.build_variant, name="build-variant", cache_policy=NONE,
                  task_run_name="build-{spec.name}")
register_task = task(steps.register, name="register-version", cache_policy=NONE,
                     task_run_name="register-{spec.name}")
window_set_task = task(steps.ensure_window_set, name="window-set", cache_policy=NONE)
reference_task = task(steps.ensure_reference, name="reference", cache_policy=NONE)
evaluate_task = task(steps.evaluate_version, name="evaluate", cache_policy=NONE, task_run_name="evaluate-{ref}")
