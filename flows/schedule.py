"""How the embedded executor (flows/quantize.py) runs a run's evaluations: one after another, or several at
once with the threads split between them.

Several variants of one source are evaluated against the same stored reference. On llama.cpp, one
evaluation is one CPU process that takes ``Settings.threads`` threads and about its file's size in memory.
Whether running them at once pays depends on how much of one evaluation leaves cores idle:

* ``llama-perplexity --kl-divergence`` scores its rows on one thread, so three of them at once (one thread
  each) took 0.926 of the time one after another on 2 cores (AMD EPYC, AVX2; ``bench/overlap.py``,
  ``bench/results/overlap_avx2.txt``; evaluating while the next type quantizes: 0.970).
* Quantyard's llama.cpp runner scores its rows on every thread, so one evaluation already keeps the cores
  busy: on the same machine its three evaluations all at once took 248.3 s against 251.3 s one after
  another (0.988, inside the run-to-run spread; ``bench/pipeline_vs_llamacpp.py --eval-jobs 0`` and
  ``--eval-jobs 1``, ``bench/results/pipeline_vs_llamacpp_avx2_evaljobs{0,1}.txt``).

So the default (``Settings.eval_jobs = 1``) is one after another: running at once gained nothing measurable
on 2 cores and holds every variant in memory at once. ``eval_jobs = 0`` runs them all at once, ``N`` at
most N at once, for machines where one evaluation does not scale to every core (not measured here: no
machine with more than 2 cores). Even then they run one after another when:

* speed is measured (``eval.speed.enabled``): a speed figure is only meaningful with the machine to itself;
* the engine is not one whose evaluation splits the CPU (``EngineInfo.cpu_shared``: only llama.cpp; vLLM
  reserves its KV cache and binds its own threads, transformers and the EXL2 reference codec dequantize the
  model into memory);
* memory: the variants evaluated at once must fit, files plus :data:`EVAL_OVERHEAD` each, in
  :data:`MEMORY_SHARE` of the memory available when the evaluations start; fewer run at once otherwise.

The choice is recorded in the run's report (``ConvertReport.eval_schedule``), each stage's ``start_s`` and
``dispatch_s`` show the overlap, and each result records the threads its engine ran with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: An allowance for what one llama.cpp evaluation holds beyond its model file: the context's KV cache, a
#: window's logits (window × vocabulary × 4 bytes: 0.5 GB for 512 tokens of a 262k vocabulary), the runner's
#: Python and numpy. An allowance, not a per-model measurement.
EVAL_OVERHEAD = 1 << 30
#: The share of available memory the evaluations run at once may take together.
MEMORY_SHARE = 0.7
#: What was measured (shown with the schedule).
MEASURED = ("measured on 2 cores: Quantyard's evaluations all at once 0.988 of one after another, "
            "llama-perplexity's 0.926")


@dataclass(frozen=True)
class EvalSchedule:
    """How a run's evaluations of one kind go: ``at_once`` of the ``evaluations`` run together, slot i with
    ``threads[i]`` threads; ``reason`` says why, in words."""

    evaluations: int
    at_once: int
    threads: list[int] = field(default_factory=list)
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _split(threads: int, k: int) -> list[int]:
    """``threads`` split into ``k`` slots as evenly as can be, every slot at least one."""
    base, extra = divmod(max(threads, k), k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def plan_evaluations(sizes: list[int], *, threads: int, jobs: int, speed: bool, mem_available: int,
                     engine: str = "llama.cpp") -> EvalSchedule:
    """How many of the evaluations whose variants have ``sizes`` bytes run at once, and their threads.

    ``jobs``: ``Settings.eval_jobs`` (1: one after another; 0: all, as far as memory allows; N: at most N). ``speed``:
    whether the evaluations measure speed. ``mem_available``: bytes of memory available now.

    ``0`` is all at once, not one per core: a slot that finishes early cannot hand its threads to an
    evaluation still running, so k slots for n > k evaluations leave cores idle at the end. With more
    evaluations than threads each gets one thread and the OS shares the cores (as ``bench/overlap.py``
    measured: three at once on two cores); a single-threaded llama.cpp process has no barriers to spin at.
    """
    n = len(sizes)
    if n <= 1:
        return EvalSchedule(n, 1, [threads], "one evaluation")
    if speed:
        return EvalSchedule(n, 1, [threads], f"one after another: speed is measured, and a speed figure needs "
                                             f"the machine to itself (--no-speed lets the {engine} evaluations "
                                             "run at once)")
    if jobs == 1:
        return EvalSchedule(n, 1, [threads], f"one after another (eval_jobs 1, the default; {MEASURED}; "
                                             "--eval-jobs 0 runs them all at once)")
    cap = min(n, jobs) if jobs > 0 else n
    budget = MEMORY_SHARE * mem_available
    largest = sorted(sizes, reverse=True)
    k = cap
    while k > 1 and sum(largest[:k]) + k * EVAL_OVERHEAD > budget:
        k -= 1
    if k == 1:
        return EvalSchedule(n, 1, [threads], f"one after another: two of these variants and their engines "
                                             f"({(sum(largest[:2]) + 2 * EVAL_OVERHEAD) / 2**30:.1f} GiB) do not "
                                             f"fit in {MEMORY_SHARE:.0%} of the {mem_available / 2**30:.1f} GiB "
                                             "available")
    split = _split(threads, k)
    why = (f"{k} {engine} evaluations at once (eval_jobs {jobs}), {'/'.join(map(str, split))} threads each, no "
           f"speed measured ({MEASURED})")
    if k < cap:
        why += (f"; {k}, not {cap}: {cap} variants and their engines do not fit in {MEMORY_SHARE:.0%} of the "
                f"{mem_available / 2**30:.1f} GiB available")
    return EvalSchedule(n, k, split, why)


__all__ = ["EVAL_OVERHEAD", "MEMORY_SHARE", "EvalSchedule", "plan_evaluations"]
