"""Load generation: GuideLLM drives a server's OpenAI-compatible API; Quantyard computes the metrics.

GuideLLM 0.8.1 (the vLLM project's load generator) runs as a subprocess in the managed ``guidellm`` tool
environment (``quantyard env ensure guidellm``), one GuideLLM benchmark per load level, through
``evaluators.serving.guidellm_runner`` (``guidellm run --scenario FILE`` with a backend that also records
every chunk's arrival time). Its JSON report is kept per level; from its per-request timestamps this module
builds :class:`~pipeline.serving.RequestRecord` s and ``evaluators.serving.metrics`` computes every number.
GuideLLM's own aggregates are not used: its names differ from ``vllm bench serve``'s (its "ITL" is TPOT).

What every request is (:func:`guidellm_scenario`): ``POST /v1/completions``, streamed (GuideLLM sends
``stream_options: {include_usage: true, continuous_usage_stats: true}``), a synthetic prompt of exactly
``profile.prompt_tokens`` tokens by the variant's own tokenizer (GuideLLM's ``synthetic_text``: Faker text
cut to that many tokens, each prompt led by its own sequence number, so no two prompts share more than a
few leading tokens and a server's prefix cache cannot serve them), ``max_tokens = profile.output_tokens``
with ``ignore_eos`` and an explicit ``temperature``. Each level uses its own data seed. HTTP/1.1 (like curl
and ``vllm bench serve``).

Levels (:func:`profile_levels`): closed loop, ``concurrent`` in GuideLLM (``streams`` = users: each user sends
its next request when its previous one ends), one level per ``profile.concurrencies``; open loop, GuideLLM's
``poisson`` at each of ``profile.rates`` requests/s. Each level sends ``warmup_requests + requests_per_level``
requests, plus in a closed loop a cool-down tail of one request per user (:func:`tail_requests`); by send time,
the first ``warmup_requests`` are warm-up and the tail is cool-down, both dropped before any metric, and the
``requests_per_level`` between them are measured (GuideLLM's own time-based warm-up is not used). The tail runs
while users stop, with fewer requests in flight than the level's users, and GuideLLM 0.8.1 can finalize a
closed-loop benchmark while its last request is still in flight, leaving it out of its report (seen here at 1
user: 7 sent, 6 reported). A request that passes
``profile.timeout_s`` fails (the backend's deadline, and GuideLLM's read timeout for a silent server). An
open-loop sweep stops after the first rate that does not meet the SLO (``metrics.level_meets_slo``): that rate
and the one below it are the knee (``metrics.find_knee``), so a saturated server is a measured knee, not a
run that times out.

Profiles: :func:`seed_profile` (the seed's shape: 512 prompt / 256 output tokens, 1/8/32/64 users; for a
GPU), :func:`cpu_profile` (``cpu-scaled``: smaller shapes, fewer requests and levels, saying so in
``note``), :func:`sweep_profile` (Poisson rates, e.g. :func:`sweep_rates` of a closed loop's throughput).

Clock: GuideLLM stamps requests with ``time.time()`` (wall clock) in its worker process; records are relative
to the first measured send. A level lasts seconds to minutes, where clock slewing is negligible.
"""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from evaluators.serving.metrics import Level, Slo, level_meets_slo, level_stats
from pipeline import envs
from pipeline.config import Settings
from pipeline.errors import EngineError
from pipeline.fs import write_atomic
from pipeline.proc import child_env, failure_log_dir, run_logged
from pipeline.serving import LevelStats, LoadProfile, RequestRecord

GUIDELLM_VERSION = "0.8.1"
TOOL = f"guidellm {GUIDELLM_VERSION}"
ENV = "guidellm"
RUNNER = "evaluators.serving.guidellm_runner"
KEEPER = "evaluators.serving.keeper"
REQUEST_FORMAT = "/v1/completions"
#: The default goodput objective: TTFT ≤ 1 s and TPOT ("ITL" in the profile, as in vLLM's goodput) ≤ 100 ms.
DEFAULT_SLO = Slo(ttft_ms=1000.0, tpot_ms=100.0)
#: The default open-loop sweep, as fractions of the best closed-loop request throughput (see sweep_rates).
SWEEP_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
#: Seconds allowed for GuideLLM to start (imports, tokenizer, worker spawn) on top of a level's own bound.
STARTUP_S = 240.0
#: GuideLLM worker processes: one asyncio process holds hundreds of streams (as vllm bench serve does) and
#: leaves the CPU to the server.
WORKERS = 1
#: Seconds GuideLLM waits between starting its worker processes and the first scheduled request (its default is
#: 1 s). Poisson arrival times are counted from that start: workers that start later, as on a busy 2-core
#: machine, find every arrival already due and send them at once (seen here: 16 requests in 0.04 s at 2/s).
START_DELAY_S = 5.0
#: A Poisson level whose measured requests were sent within this fraction of the time its rate implies was not
#: paced by GuideLLM (for 16 requests the chance of that from a Poisson process is below 1e-10): an error.
BURST_FRACTION = 0.1
#: GuideLLM runs of a Poisson level before a burst is an error. GuideLLM 0.8.1 now and then sends a whole level at
#: once even with the start delay above (seen here in a full test run, 2026-12-02: 16 requests in 0.019 s at 60/s,
#: every one started 5 s before the scheduler's own start_time; the same level alone was paced): the level is run
#: again, the burst's files kept beside it, and the level records how many runs it took.
PACING_ATTEMPTS = 2
#: Seconds a measured request of a Poisson level may leave before its scheduled arrival (GuideLLM's
#: ``targeted_start``): earlier, and GuideLLM did not pace it. This also catches a burst that hits only part of a
#: level, which the span check below misses (one possible cause, not a proven one, of a 2/s level of the test
#: server missing a 300 ms TTFT bound once in a CI run, 2026-12-02). Paced, here (2 cores, both busy with other
#: work), the first send of a level was 30-50 ms late and the others 2-8 ms late; none was early.
EARLY_S = 0.05


class LevelPeaks(Protocol):
    """What a sampler's ``end_level`` returns (``evaluators.serving.memory.LevelPeak``): peaks in bytes."""

    @property
    def rss_peak_bytes(self) -> int | None: ...

    @property
    def device_peak_bytes(self) -> int | None: ...


class LevelSampler(Protocol):
    """Samples the server's memory around each level (``evaluators.serving.memory.MemorySampler``); its
    ``end_level`` returns the level's peaks, or a plain peak RSS in bytes."""

    def start_level(self) -> None: ...

    def end_level(self) -> LevelPeaks | int | None: ...


def _peaks(reading: LevelPeaks | int | None) -> dict[str, int | None]:
    if reading is None or isinstance(reading, int):
        return {"rss_peak_bytes": reading}
    return {"rss_peak_bytes": reading.rss_peak_bytes, "device_peak_bytes": reading.device_peak_bytes}


@dataclass(frozen=True)
class Target:
    """The server under load: its base URL, the model name it serves, the tokenizer folder prompts are made with."""

    base_url: str
    model: str
    tokenizer: Path


# --- profiles -----------------------------------------------------------------------------------------------


def seed_profile(requests_per_level: int = 128, warmup_requests: int = 8, timeout_s: float = 300.0) -> LoadProfile:
    """The seed's closed loop: 512 prompt / 256 output tokens at 1, 8, 32 and 64 users (for a GPU)."""
    return LoadProfile(name="seed", tool=TOOL, prompt_tokens=512, output_tokens=256, concurrencies=[1, 8, 32, 64],
                       requests_per_level=requests_per_level, warmup_requests=warmup_requests, timeout_s=timeout_s,
                       slo_ttft_ms=DEFAULT_SLO.ttft_ms, slo_itl_ms=DEFAULT_SLO.tpot_ms)


def cpu_profile(requests_per_level: int = 48, warmup_requests: int = 2, timeout_s: float = 120.0) -> LoadProfile:
    """The closed loop scaled for a CPU: 128 prompt / 32 output tokens at 1, 8 and 32 users."""
    seed = seed_profile()
    note = (f"CPU: scaled from the seed shape {seed.prompt_tokens}/{seed.output_tokens} prompt/output tokens, "
            f"{'/'.join(map(str, seed.concurrencies))} users, {seed.requests_per_level} requests per level")
    return LoadProfile(name="cpu-scaled", tool=TOOL, prompt_tokens=128, output_tokens=32, concurrencies=[1, 8, 32],
                       requests_per_level=requests_per_level, warmup_requests=warmup_requests, timeout_s=timeout_s,
                       slo_ttft_ms=DEFAULT_SLO.ttft_ms, slo_itl_ms=DEFAULT_SLO.tpot_ms, note=note)


def sweep_profile(rates: Sequence[float], shape: LoadProfile | None = None, slo: Slo = DEFAULT_SLO,
                  requests_per_level: int | None = None) -> LoadProfile:
    """An open-loop Poisson sweep at ``rates`` (requests/s, ascending) with ``shape``'s prompt/output tokens,
    requests, warm-up and timeout (default: the seed's), judged against ``slo``.

    Raises:
        ValueError: no rate, or a rate ≤ 0.
    """
    if not rates or min(rates) <= 0:
        raise ValueError(f"a sweep needs positive rates, got {list(rates)}")
    base = shape or seed_profile()
    note = f"open-loop Poisson sweep on the {base.name} shape {base.prompt_tokens}/{base.output_tokens}"
    return base.model_copy(update={
        "name": "sweep", "concurrencies": [], "rates": sorted(float(r) for r in rates),
        "requests_per_level": requests_per_level or base.requests_per_level,
        "slo_ttft_ms": slo.ttft_ms, "slo_itl_ms": slo.tpot_ms,
        "note": note if base.note is None else f"{note}; {base.note}"})


def sweep_rates(levels: Sequence[LevelStats], fractions: Sequence[float] = SWEEP_FRACTIONS) -> list[float]:
    """Poisson rates around saturation: ``fractions`` of the best closed-loop request throughput in ``levels``.

    Raises:
        ValueError: no closed-loop level measured a request throughput.
    """
    best = max((lv.request_throughput for lv in levels
                if lv.mode == "concurrency" and lv.request_throughput), default=None)
    if best is None:
        raise ValueError("no closed-loop level with a request throughput to place the sweep around")
    return [round(best * f, 4) for f in fractions]


def profile_levels(profile: LoadProfile) -> list[Level]:
    """The profile's levels in run order: its concurrencies, then its rates (ascending)."""
    return ([Level(mode="concurrency", concurrency=c) for c in profile.concurrencies]
            + [Level(mode="poisson", rate=r) for r in sorted(profile.rates)])


def profile_slo(profile: LoadProfile) -> Slo | None:
    """The profile's goodput objective (its ITL bound applies to TPOT), or None when it sets none."""
    if profile.slo_ttft_ms is None and profile.slo_itl_ms is None:
        return None
    return Slo(ttft_ms=profile.slo_ttft_ms, tpot_ms=profile.slo_itl_ms)


# --- one level ----------------------------------------------------------------------------------------------


def guidellm_scenario(target: Target, profile: LoadProfile, level: Level, seed: int, report: Path) -> dict[str, Any]:
    """The GuideLLM 0.8.1 scenario (``guidellm run --scenario``) for one level (see the module docstring)."""
    strategy: dict[str, Any] = ({"kind": "concurrent", "streams": [level.concurrency]} if level.mode == "concurrency"
                                else {"kind": "poisson", "rate": [level.rate]})
    body = {"temperature": profile.temperature, "ignore_eos": profile.ignore_eos}
    return {"spec": {
        "backend": {"kind": "openai_http", "target": target.base_url, "model": target.model,
                    "request_format": REQUEST_FORMAT, "timeout": profile.timeout_s, "http2": False,
                    "stream": True, "validate_backend": False, "extras": {"body": body}},
        "profile": strategy,
        "constraints": [{"kind": "max_requests", "count": requests_sent(profile, level)}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(target.tokenizer)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": profile.prompt_tokens,
                  "output_tokens": profile.output_tokens}],
        "seed": {"kind": "static", "value": seed},
        "outputs": [{"kind": "json", "path": str(report)}],
        "metrics": {"kind": "generative", "sample_size": None}}}


def tail_requests(level: Level) -> int:
    """Requests sent after the measured ones and not measured: one per user in a closed loop, none in an open
    loop (its arrivals do not wait for the measured requests)."""
    return (level.concurrency or 1) if level.mode == "concurrency" else 0


def requests_sent(profile: LoadProfile, level: Level) -> int:
    """Warm-up, measured and tail requests of one level."""
    return profile.warmup_requests + profile.requests_per_level + tail_requests(level)


def level_timeout_s(profile: LoadProfile, level: Level) -> float:
    """A bound on one level's GuideLLM run: every request at its timeout, in waves of ``concurrency`` (closed
    loop) or after the last Poisson arrival (open loop), plus :data:`STARTUP_S`."""
    total = requests_sent(profile, level)
    if level.mode == "concurrency":
        busy = math.ceil(total / max(1, level.concurrency or 1)) * profile.timeout_s
    else:
        busy = 3 * total / float(level.rate or 1.0) + profile.timeout_s
    return busy + STARTUP_S


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _record(entry: dict[str, Any], t0: float, open_loop: bool) -> RequestRecord:
    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 6)

    usage = entry.get("usage") or {}
    error = entry.get("error")
    if error is None and entry.get("status") != "successful":
        error = str(entry.get("status"))
    if error is None and entry.get("first_token") is None:
        error = "no content token received"
    return RequestRecord(t_sent=round(entry["request_start"] - t0, 6),
                         t_target=rel(entry.get("targeted_start")) if open_loop else None,
                         t_first=rel(entry.get("first_token")),
                         t_last=rel(entry.get("last_token")),
                         token_times=[round(t - t0, 6) for t in entry.get("token_times") or []],
                         prompt_tokens=_int(usage.get("prompt_tokens")),
                         output_tokens=_int(usage.get("completion_tokens")),
                         output_tokens_client=_int(entry.get("output_tokens_client")), error=error)


def to_records(entries: Sequence[dict[str, Any]], warmup: int, measured_n: int | None = None,
               open_loop: bool = False) -> list[RequestRecord]:
    """The measured requests of one level: the runner's entries that were sent, by send time, without the first
    ``warmup`` and, given ``measured_n``, without those after the first ``measured_n`` measured (the tail); times
    relative to the first measured send. ``open_loop`` (a Poisson level) keeps each request's scheduled
    arrival (``t_target``); a closed loop's is only "as soon as the user is free" and is left out."""
    sent = sorted((e for e in entries if e.get("request_start") is not None), key=lambda e: e["request_start"])
    measured = sent[warmup:] if measured_n is None else sent[warmup:warmup + measured_n]
    if not measured:
        return []
    t0 = float(measured[0]["request_start"])
    return [_record(e, t0, open_loop) for e in measured]


def level_label(level: Level) -> str:
    """``c8`` (8 users) or ``r2.5`` (2.5 requests/s)."""
    return f"c{level.concurrency}" if level.mode == "concurrency" else f"r{level.rate:g}"


def run_level(python: str, target: Target, profile: LoadProfile, level: Level, level_dir: Path,
              settings: Settings, seed: int = 1) -> tuple[list[RequestRecord], int]:
    """Run GuideLLM for one level and return its measured requests' records and the number of GuideLLM runs it
    took: a Poisson level that went out in a burst (:func:`check_paced`) is run again, up to
    :data:`PACING_ATTEMPTS` runs, the burst's files moved to ``<level_dir>.burst<N>``. The files of the run used
    stay in ``level_dir`` (``request.json``, ``scenario.json``, ``guidellm-report.json``, ``requests.json``, logs).

    Raises:
        EngineError: GuideLLM failed, timed out or wrote no result (the message names its log), or every run of
            a Poisson level went out in a burst.
    """
    for attempt in range(1, PACING_ATTEMPTS + 1):
        records = _run_level_once(python, target, profile, level, level_dir, settings, seed)
        try:
            check_paced(records, level, level_dir)
        except EngineError:
            if attempt == PACING_ATTEMPTS:
                raise
            level_dir.rename(level_dir.with_name(f"{level_dir.name}.burst{attempt}"))
            continue
        return records, attempt
    raise AssertionError("unreachable")


def _run_level_once(python: str, target: Target, profile: LoadProfile, level: Level, level_dir: Path,
                    settings: Settings, seed: int) -> list[RequestRecord]:
    level_dir.mkdir(parents=True, exist_ok=True)
    result = level_dir / "requests.json"
    request = {"scenario": guidellm_scenario(target, profile, level, seed, level_dir / "guidellm-report.json"),
               "tokenizer": str(target.tokenizer), "timeout_s": profile.timeout_s, "result": str(result)}
    write_atomic(level_dir / "request.json", json.dumps(request, indent=1))
    env = child_env({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
                     "GUIDELLM__MAX_WORKER_PROCESSES": str(WORKERS),
                     "GUIDELLM__SCHEDULER_START_DELAY_NON_DISTRIBUTED": str(START_DELAY_S)})
    # Under the keeper (evaluators/serving/keeper.py), as servers are: GuideLLM spawns worker processes of
    # its own, which the death signal of run_logged would not reach, and a killed run must leave none.
    keeper = [python, "-m", KEEPER, str(os.getpid()), "--"]
    res = run_logged([*keeper, python, "-m", RUNNER, str(level_dir / "request.json")], log_dir=level_dir,
                     name="guidellm",
                     timeout_s=level_timeout_s(profile, level), env=env, cwd=level_dir,
                     keep=failure_log_dir(settings.logs_root))
    if not res.ok or not result.is_file():
        raise EngineError(f"GuideLLM {res.describe()} at level {level_label(level)} against {target.base_url}",
                          engine=ENV, returncode=res.returncode, stderr_tail=res.stderr_tail,
                          hint=f"read {res.log}")
    entries = json.loads(result.read_text())["requests"]
    return to_records(entries, profile.warmup_requests, profile.requests_per_level,
                      open_loop=level.mode == "poisson")


def check_paced(records: Sequence[RequestRecord], level: Level, level_dir: Path) -> None:
    """Fail a Poisson level whose requests went out in a burst instead of at its rate (see :data:`EARLY_S` and
    :data:`BURST_FRACTION`).

    Raises:
        EngineError: a measured request was sent more than EARLY_S before its scheduled arrival, or the measured
            requests' send times span less than BURST_FRACTION of (n - 1) / rate.
    """
    if level.mode != "poisson" or not level.rate:
        return
    early = [r for r in records if r.t_target is not None and r.t_sent < r.t_target - EARLY_S]
    if early:
        worst = max(r.t_target - r.t_sent for r in early if r.t_target is not None)
        raise _unpaced(f"GuideLLM sent {len(early)} of {len(records)} requests before their scheduled Poisson "
                       f"arrival at {level.rate:g}/s (up to {worst:.3f} s early)", level_dir)
    if len(records) < 3:
        return
    span = max(r.t_sent for r in records) - min(r.t_sent for r in records)
    expected = (len(records) - 1) / level.rate
    if span < BURST_FRACTION * expected:
        raise _unpaced(f"GuideLLM sent {len(records)} requests in {span:.3f} s at a Poisson rate of "
                       f"{level.rate:g}/s (about {expected:.1f} s expected)", level_dir)


def _unpaced(what: str, level_dir: Path) -> EngineError:
    return EngineError(f"{what}: the arrivals were not paced, so the level measures a burst, not its rate",
                       engine=ENV, hint=f"its workers probably started late on a busy machine; read "
                                        f"{level_dir}/guidellm.err and run it again on a quieter machine")


def check_server(base_url: str, timeout_s: float = 10.0) -> None:
    """Fail early unless an OpenAI-compatible server answers ``GET /v1/models`` at ``base_url``.

    Raises:
        EngineError: nothing answers, or it answers with an HTTP error.
    """
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            resp.read()
    except (urllib.error.URLError, OSError) as exc:
        raise EngineError(f"no OpenAI-compatible server answers at {url}: {exc}", engine="server",
                          hint="start the server first (evaluators.serving.server.start_server)") from exc


# --- a whole profile ----------------------------------------------------------------------------------------


def run_load(base_url: str, model: str, tokenizer: Path, profile: LoadProfile, settings: Settings, out_dir: Path,
             on_level: Callable[[LevelStats], None] | None = None,
             sampler: LevelSampler | None = None) -> list[LevelStats]:
    """Load the server at ``base_url`` (serving ``model``) with every level of ``profile`` and return one
    :class:`LevelStats` per level run, in order. Prompts are made with the tokenizer folder ``tokenizer`` (the
    variant's source tokenizer). ``on_level`` gets each level as soon as it is measured; ``sampler`` (the
    server's memory sampler) is started before and read after each level, filling ``rss_peak_bytes`` (and
    ``device_peak_bytes``). An
    open-loop sweep stops after the first rate that misses the profile's SLO. GuideLLM's files go to
    ``out_dir/<level>/``.

    Raises:
        ToolchainMissingError: the ``guidellm`` environment is not built (``quantyard env ensure guidellm``).
        EngineError: the server does not answer, or GuideLLM failed at a level.
    """
    python = envs.python_for(ENV, settings)
    check_server(base_url)
    target, slo, levels = Target(base_url, model, Path(tokenizer)), profile_slo(profile), []
    for index, level in enumerate(profile_levels(profile), start=1):
        if sampler is not None:
            sampler.start_level()
        level_dir = out_dir / f"{index:02d}-{level_label(level)}"
        records, attempts = run_level(python, target, profile, level, level_dir, settings, seed=index)
        peaks = _peaks(sampler.end_level()) if sampler is not None else {}
        stats = level_stats(records, level, slo, prompt_tokens_client=profile.prompt_tokens).model_copy(
            update={**peaks, "attempts": attempts})
        levels.append(stats)
        if on_level is not None:
            on_level(stats)
        if level.mode == "poisson" and slo is not None and not level_meets_slo(stats, slo):
            break
    return levels
