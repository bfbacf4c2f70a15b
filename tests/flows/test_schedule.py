"""flows/schedule.py: how many llama.cpp evaluations an embedded run starts at once, and their threads."""

from __future__ import annotations

from flows.schedule import EVAL_OVERHEAD, MEMORY_SHARE, plan_evaluations

GIB = 1 << 30
MB = 1 << 20


def test_all_at_once_gives_every_evaluation_a_share_of_the_threads() -> None:
    two = plan_evaluations([100 * MB] * 3, threads=2, jobs=0, speed=False, mem_available=20 * GIB)
    assert (two.evaluations, two.at_once, two.threads) == (3, 3, [1, 1, 1])  # as bench/overlap.py measured
    sixteen = plan_evaluations([100 * MB] * 3, threads=16, jobs=0, speed=False, mem_available=20 * GIB)
    assert (sixteen.at_once, sixteen.threads) == (3, [6, 5, 5]) and sum(sixteen.threads) == 16
    assert "3 llama.cpp evaluations at once" in sixteen.reason and "0.988" in sixteen.reason


def test_speed_one_job_one_thread_or_one_evaluation_run_one_after_another() -> None:
    cases = {
        "speed is measured": {"speed": True, "jobs": 0, "threads": 8, "n": 3},
        "eval_jobs 1, the default": {"speed": False, "jobs": 1, "threads": 8, "n": 3},
        "one evaluation": {"speed": False, "jobs": 0, "threads": 8, "n": 1},
    }
    for why, c in cases.items():
        s = plan_evaluations([MB] * c["n"], threads=c["threads"], jobs=c["jobs"], speed=c["speed"],
                             mem_available=20 * GIB)
        assert (s.at_once, s.threads) == (1, [c["threads"]]) and why in s.reason, (why, s)


def test_eval_jobs_caps_the_evaluations_at_once() -> None:
    s = plan_evaluations([MB] * 6, threads=16, jobs=2, speed=False, mem_available=20 * GIB)
    assert (s.at_once, s.threads) == (2, [8, 8])
    more = plan_evaluations([MB] * 6, threads=2, jobs=4, speed=False, mem_available=20 * GIB)
    assert (more.at_once, more.threads) == (4, [1, 1, 1, 1])  # asked for: one thread each, cores shared


def test_memory_limits_how_many_run_at_once() -> None:
    sizes = [8 * GIB, 5 * GIB, 3 * GIB, 2 * GIB]  # Q8_0 / Q4_K_M / Q2_K-like of an 8 B model, and a small one
    avail = 24 * GIB  # budget 16.8 GiB: the largest three with overheads (19 GiB) do not fit, two (15 GiB) do
    s = plan_evaluations(sizes, threads=16, jobs=0, speed=False, mem_available=avail)
    assert sum(sorted(sizes)[-2:]) + 2 * EVAL_OVERHEAD <= MEMORY_SHARE * avail
    assert (s.at_once, s.threads) == (2, [8, 8]) and "do not fit" in s.reason
    none = plan_evaluations(sizes, threads=16, jobs=0, speed=False, mem_available=12 * GIB)
    assert (none.at_once, none.threads) == (1, [16]) and "do not fit" in none.reason


def test_the_default_is_one_after_another() -> None:
    from pipeline.config import Settings

    s = plan_evaluations([MB] * 3, threads=2, jobs=Settings().eval_jobs, speed=False, mem_available=20 * GIB)
    assert (s.at_once, s.threads) == (1, [2]) and "--eval-jobs 0" in s.reason
