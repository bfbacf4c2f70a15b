"""``quantyard doctor``: what this machine has and what Quantyard can run on it, and what has run on a GPU.

Reads the same sources as the documentation: the CPU's flags (pipeline/cpu.py), the memory and disk the pre-flight
compares plans with (pipeline/resources.py), the tools' availability, and the record of GPU paths
(pipeline/status.py).
"""

from __future__ import annotations

from typing import Any

from pipeline.cli.common import JsonOpt, handle_errors, settings


@handle_errors
def doctor(as_json: JsonOpt = False) -> None:
    """What this machine has (CPU flags, memory, disk, accelerator, tools) and the record of GPU paths."""
    from pipeline import __version__, resources
    from pipeline.cpu import cpu_flags
    from pipeline.envs import detect_accelerator
    from pipeline.llama_cpp import unavailable_reason
    from pipeline.status import GPU_PATHS

    cfg = settings(None)
    mem = resources.memory(cfg.memory_budget)
    report: dict[str, Any] = {
        "quantyard": __version__, "cpu_flags": cpu_flags(), "threads": cfg.threads,
        "accelerator": detect_accelerator(cfg),
        "memory": {"available": mem.available, "total": mem.total, "limited_by": mem.limited_by},
        "disk_free": {"work": resources.disk_free(cfg.work_root), "cache": resources.disk_free(cfg.cache_dir)},
        "llama_cpp": unavailable_reason(cfg) or "ready",
        "gpu_paths": [{"path": r.path, "status": r.status.value, "detail": r.detail, "evidence": r.evidence,
                       "check": r.check} for r in GPU_PATHS],
    }
    if as_json:
        from pipeline.render import print_json

        print_json(report)
        return
    from rich.table import Table

    from pipeline.render import console

    console.print(f"quantyard {__version__} · CPU flags: {report['cpu_flags'] or 'unknown'} · threads "
                  f"{cfg.threads} · accelerator: {report['accelerator']}")
    console.print(f"memory: {mem.describe()} · disk free: work {resources.gib(report['disk_free']['work'])}, "
                  f"cache {resources.gib(report['disk_free']['cache'])} · llama.cpp: {report['llama_cpp']}")
    table = Table(title="GPU paths: what has run on a GPU (pipeline/status.py)", title_justify="left")
    for col in ("path", "status", "evidence"):
        table.add_column(col)
    for r in GPU_PATHS:
        table.add_row(r.path, r.status.value, f"bench/results/{r.evidence}" if r.evidence else "—")
    console.print(table)


def register(app: Any) -> None:
    app.command()(doctor)
