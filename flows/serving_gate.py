"""``validate``'s serving check: the version's newest serving result at the policy's concurrency against the
policy's serving SLO (:class:`pipeline.policy.ServingSLO`).

Skipped, with the reason, when the policy sets no serving SLO, the target is a plain file (no registry record)
or the version has no ok serving result with a closed-loop level at that concurrency. Otherwise it passes only
when every limit the SLO sets is met by a measured figure: a figure the level lacks fails (a gate never passes on
a missing number), and so do failed requests beyond ``max_failed_pct``. The message puts each measured value next
to its limit, and says when the load shape was CPU-scaled or vLLM's 4-bit kernel was replaced.
"""

from __future__ import annotations

from typing import Any

from pipeline.checks import CheckFailed, CheckSkipped
from pipeline.policy import ServingSLO
from pipeline.serving_summary import LevelPoint, ServingSummary, serving_results, summarize
from registry.views import VersionView

#: The SLO's limits: (limit field, figure of the level, label, unit, the limit is a maximum).
LIMITS: tuple[tuple[str, str, str, str, bool], ...] = (
    ("p99_ttft_ms", "ttft_p99_ms", "p99 TTFT", "ms", True),
    ("p99_itl_ms", "itl_p99_ms", "p99 ITL", "ms", True),
    ("p99_tpot_ms", "tpot_p99_ms", "p99 TPOT", "ms", True),
    ("min_output_throughput", "output_throughput", "output throughput", "tok/s", False),
)


def newest_at(version: VersionView, concurrency: int) -> tuple[ServingSummary, LevelPoint] | None:
    """The newest ok serving result of ``version`` (any engine) with a closed-loop level at ``concurrency``."""
    for r in reversed(serving_results(version.results)):
        s = summarize(version.variant, version.ref, version.format, r)
        level = s.level(concurrency) if s is not None else None
        if s is not None and level is not None:
            return s, level
    return None


def _measured_levels(version: VersionView) -> str:
    found = sorted({lv.concurrency for r in serving_results(version.results)
                    if (s := summarize(version.variant, version.ref, version.format, r)) is not None
                    for lv in s.levels})
    return ", ".join(map(str, found)) or "none"


def gate_lines(slo: ServingSLO, level: LevelPoint) -> tuple[list[str], list[str]]:
    """Every set limit beside the measured value (``p99 TTFT 812 ms ≤ 1000 ms: ok``), and the problems."""
    lines, problems = [], []
    for field, key, label, unit, is_max in LIMITS:
        bound = getattr(slo, field)
        if bound is None:
            continue
        value = level.value(key)
        if value is None:
            text = f"{label} not measured (needed by {field} {bound:g} {unit})"
            lines.append(text + ": FAIL")
            problems.append(text)
            continue
        ok = value <= bound if is_max else value >= bound
        text = f"{label} {value:.4g} {unit} {'≤' if is_max else '≥'} {bound:g} {unit}"
        lines.append(text + (": ok" if ok else ": FAIL"))
        if not ok:
            problems.append(f"{label} {value:.4g} {unit} {'>' if is_max else '<'} {bound:g} {unit}")
    failed_pct = 100.0 * level.failed / level.requests if level.requests else 0.0
    lines.append(f"failed requests {level.failed}/{level.requests} ({failed_pct:.3g} %) ≤ {slo.max_failed_pct:g} %"
                 + (": ok" if failed_pct <= slo.max_failed_pct else ": FAIL"))
    if failed_pct > slo.max_failed_pct:
        problems.append(f"{level.failed} of {level.requests} requests failed ({failed_pct:.3g} % > "
                        f"{slo.max_failed_pct:g} %): the percentiles leave them out")
    return lines, problems


def _labels(s: ServingSummary) -> list[str]:
    out = []
    if s.cpu_scaled:
        out.append(f"CPU-scaled load shape ({s.profile_note or s.shape})")
    if s.kernel:
        out.append(f"vLLM's 4-bit kernel replaced by a dense matmul ({s.kernel})")
    return out


def check_serving(version: VersionView | None, slo: ServingSLO | None) -> tuple[str, dict[str, Any]]:
    """The serving check of one target (see the module docstring).

    Raises:
        CheckSkipped: no SLO, no registry version, or no serving result at the SLO's concurrency.
        CheckFailed: a limit is not met or its figure was not measured.
    """
    if slo is None:
        raise CheckSkipped("the policy sets no serving SLO (serving: {concurrency: N, p99_ttft_ms: ...})")
    if version is None:
        raise CheckSkipped("a plain file has no serving result: serve-bench a registry version")
    found = newest_at(version, slo.concurrency)
    if found is None:
        raise CheckSkipped(f"{version.ref} has no serving result at {slo.concurrency} concurrent users "
                           f"(measured levels: {_measured_levels(version)})")
    s, level = found
    lines, problems = gate_lines(slo, level)
    labels = _labels(s)
    head = (f"{slo.concurrency} users on {s.server} {s.server_version} ({s.engine}), {s.shape}"
            + (f" [{'; '.join(labels)}]" if labels else ""))
    details = {"slo": slo.model_dump(), "engine": s.engine, "server": s.server, "result_id": s.result_id,
               "profile": s.profile, "profile_note": s.profile_note, "cpu_scaled": s.cpu_scaled,
               "kernel": s.kernel, "level": level.model_dump(), "gates": lines}
    if problems:
        raise CheckFailed(f"{head}: fails the serving SLO: " + "; ".join(problems) + " — gates: " + "; ".join(lines),
                          **details)
    return f"{head}: " + "; ".join(lines), details
