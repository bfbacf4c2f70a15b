"""A measured cost model of the pipeline, from 5 M to 70 B parameters: every stage of ``quantyard convert``
timed and its peak memory sampled at three model sizes built on this machine, a straight line fitted per
stage, and that line extrapolated to 8 B and 70 B. Nothing is downloaded from a model hub.

Sizes (``--sizes``, default all three, smallest first):

* ``demo``: the demo checkpoint (pipeline/demo_model.py, ~5 M parameters, fp32, vocabulary 4096).
* ``real``: SmolLM2-135M (pipeline/real_model.py, bf16, vocabulary 49152).
* ``big``: a SYNTHETIC Llama checkpoint of ~0.77 B parameters (:data:`BIG`), random weights from a fixed seed,
  bf16 safetensors, with SmolLM2's tokenizer, eval.txt and calibration.txt copied from ``real`` (so the GGUF
  converter recognises its pre-tokenizer). Built once under ``CACHE_DIR/synthetic/<config hash>``. Its costs
  are real; its PPL and KLD mean nothing and are not shown.
* any other local Hugging Face checkpoint folder, by its path (default 8 windows): a point of your own. Its
  text is its ``eval.txt``, else Quantyard's built-in held-out text (bench/pipeline_vs_llamacpp.py's
  ``eval_text_file``); its vocabulary is printed with its measurements, since the fits fold it into P.

Each size runs, in a child process with a fresh registry, cache and work dir (bench/pipeline_vs_llamacpp.py's
``CHILD`` and ``fresh_env``): ``convert CKPT --gguf Q8_0,Q4_K_M,Q2_K --gguf-base f16 --no-speed --no-noise-floor
--eval-text TEXT --window 512 --stride 512 --score-from 257 --max-windows W --threads N --reference-engine R
--json`` (R: ``--reference``, default llama.cpp: the F16 GGUF, the reference that scales to 70 B). Stage times
are the report's ``dispatch_s``; resolving the source (before the stage graph: row ``hash``) is timed by its progress
event plus the hashing the ledger's check did before it (flows/reuse.py: the CLI pins the source first, then the
resolve reads the hash cache), and its parts (``source:hash``, both hashings; ``source:check``; ``source:scan``) by
theirs. Before the parts were announced (2026-12-05) the ledger's hashing fell in ``other``.
Peak memory: the summed RSS of this process's descendants (the child and everything it starts), sampled every
:data:`SAMPLE_S` s in a thread and given to the stage whose start/end events enclose the sample (shared and
file-backed pages, e.g. a memory-mapped GGUF, count once per process: an upper bound). Tokens: windows × 512
for the reference and each evaluation (every position is run; 255 of 512 are scored), 0 otherwise.

Fits (least squares, numpy): time ≈ a + b·P (hash, resolve, F16 conversion, quantize, register; P =
parameters) or a + b·P·T (reference, evaluate; T = tokens); peak memory ≈ c + d·P. Per-type stages are
also fitted as their mean over the three types ("build", "register", "evaluate"); "other" is the command's
time outside every stage (interpreter, imports, Prefect's embedded server, registry, report). Three points and two
coefficients leave one degree of freedom: the residuals are printed, and every number past the measured range
is labelled EXTRAPOLATED. Vocabulary-dependent costs (the output head, the stored reference distribution,
the exact KLD) are folded into P at a 49152-token vocabulary; the targets' larger vocabularies are not modelled.

GPU column (``--gpu FILE``, from bench/gpu_reference.py on a GPU machine; without it, assumptions only): the
GpuModel's forward-pass and load assumptions, plus the reference stage's MEASURED start and host time per stored
entry (the exact-KLD distribution: on an H200 that, not the GPU, set the stage's time from 0.3 B to 3.6 B).

Usage: python bench/scaling.py [--sizes demo,real,big[,PATH...]] [--windows 16,16,8 | --windows 2] [--threads N]
[--out FILE] [--save FILE.json] [--load FILE.json (fit and print saved measurements; no run)] [--gpu FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: a script's own folder, not when loaded by path

import pipeline_vs_llamacpp as vs

from pipeline.config import Settings
from pipeline.cpu import cpu_flags
from pipeline.progress import RESOLVE_PARTS as PARTS

SIZES = ("demo", "real", "big", "8b")
#: Measured by default (``8b``, minutes to build and about an hour to run on 2 cores, only when asked).
DEFAULT_SIZES = ("demo", "real", "big")
DEFAULT_WINDOWS = {"demo": 16, "real": 16, "big": 8, "8b": 8}
#: Sizes whose weights are random (SYNTHETIC: costs real, PPL/KLD meaningless).
SYNTHETIC_SIZES = ("big", "8b")
FOLDER_WINDOWS = 8  # a local folder given by its path
SAMPLE_S = 0.1
GIB = 1024**3
#: The synthetic checkpoint: SmolLM2's vocabulary and special tokens, a Llama shape of ~0.77 B parameters.
BIG = {"hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 20, "num_attention_heads": 12,
       "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 49152, "max_position_embeddings": 2048,
       "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
BIG_SEED = 0
BIG_COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "eval.txt", "calibration.txt")
#: Stages whose time grows with P·T (T: tokens run through the model); all others with P.
TOKEN_STAGES = ("reference", "evaluate")
PER_TYPE = ("build", "register", "evaluate")


# --- the cost model: pure functions ----------------------------------------------------------------


class UnderdeterminedFitError(ValueError):
    """A line needs two distinct x values; ``quantity`` had fewer."""

    def __init__(self, quantity: str, xs: list[float]) -> None:
        self.quantity, self.xs = quantity, xs
        super().__init__(f"cannot fit {quantity}: expected at least 2 distinct x values, got {len(set(xs))} "
                         f"({xs}); measure at least two model sizes (--sizes)")


@dataclass(frozen=True)
class LinearFit:
    """``y ≈ a + b·x``, least squares over the measured ``(xs, ys)``."""

    quantity: str
    x_name: str  # "P" or "P·T"
    a: float
    b: float
    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def predict(self, x: float) -> float:
        return self.a + self.b * x

    def residuals(self) -> tuple[float, ...]:
        """Measured minus fitted, at each measured point."""
        return tuple(y - self.predict(x) for x, y in zip(self.xs, self.ys, strict=True))


def fit_line(xs: list[float], ys: list[float], quantity: str, x_name: str = "P") -> LinearFit:
    """Least-squares ``a + b·x`` through the points. Raises UnderdeterminedFitError with fewer than two
    distinct x values, ValueError when the lists differ in length."""
    if len(xs) != len(ys):
        raise ValueError(f"{quantity}: expected as many y values as x values, got {len(ys)} and {len(xs)}")
    if len(set(xs)) < 2:
        raise UnderdeterminedFitError(quantity, list(xs))
    scale = max(abs(x) for x in xs)  # x spans 1e6..1e13: solve on x/scale, so the columns are comparable
    design = np.column_stack([np.ones(len(xs)), np.asarray(xs, dtype=float) / scale])
    (a, b), *_ = np.linalg.lstsq(design, np.asarray(ys, dtype=float), rcond=None)
    return LinearFit(quantity, x_name, float(a), float(b) / scale, tuple(map(float, xs)), tuple(map(float, ys)))


@dataclass(frozen=True)
class Extrapolated:
    """A fitted line's value at ``x``: a prediction, never a measurement. ``str()`` carries the label."""

    quantity: str
    target: str
    x: float
    value: float
    unit: str
    label: str  # EXTRAPOLATED (x outside the measured range) or INTERPOLATED

    def __str__(self) -> str:
        hours = f" = {self.value / 3600:.3g} h" if self.unit == "s" and self.value >= 3600 else ""
        return f"{_num(self.value)} {self.unit}{hours} ({self.label})"


def extrapolate(fit: LinearFit, x: float, target: str, unit: str, count: int = 1) -> Extrapolated:
    """``count`` × the fit's value at ``x`` (``count``: e.g. six quantization types), labelled."""
    inside = min(fit.xs) <= x <= max(fit.xs)
    if not inside and fit.b <= 0:  # no growth measured (noise around a constant): never a negative prediction
        return Extrapolated(fit.quantity, target, x, count * max(fit.ys), unit,
                            "EXTRAPOLATED flat: fitted slope ≤ 0, the largest measurement shown")
    return Extrapolated(fit.quantity, target, x, count * fit.predict(x), unit,
                        "INTERPOLATED" if inside else "EXTRAPOLATED")


@dataclass(frozen=True)
class Target:
    name: str
    params: float
    vocab: int


@dataclass(frozen=True)
class Job:
    """The job extrapolated to: an F16 base, ``types`` GGUF types built, registered and evaluated, one
    reference; ``windows`` × ``window`` tokens, positions ``score_from``..``window - 1`` scored."""

    types: int = 6
    windows: int = 64
    window: int = 512
    score_from: int = 257
    #: the types counted in the disk estimate (llama.cpp's usual six)
    type_names: tuple[str, ...] = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")

    @property
    def tokens(self) -> int:
        return self.windows * self.window

    @property
    def scored(self) -> int:
        return self.windows * (self.window - self.score_from)


TARGETS = (Target("8B (Llama-3-8B-like)", 8.0e9, 128256), Target("70B (Llama-3-70B-like)", 70.6e9, 128256))
#: (fitted group, how many per job, what it is) in the order a run does them.
JOB_STAGES = (("hash", "1", "hash the source"), ("resolve", "1", "resolve stage"),
              ("prepare:gguf", "1", "F16 conversion"), ("build", "types", "quantize (mean per type)"),
              ("register", "types", "register (mean per type)"), ("reference", "1", "reference"),
              ("evaluate", "types", "evaluate (mean per type)"),
              ("other", "1", "other: interpreter, imports, Prefect, registry, report"))


#: The parts of the "hash" group (the source's resolve event), as pipeline/progress.py's RESOLVE_PARTS name their
#: progress events -> their group here. Measured since the parts were announced (older measurement files lack
#: them); where all three are fitted the job is extrapolated from them instead of "hash": the checks are a fixed
#: cost (imports, config, a model on the meta device, the tokenizer) that the whole event's line mixed with the
#: per-byte hash and scan, so that line's slope was noise at these sizes.
SOURCE_PARTS = {PARTS[k]: f"source:{k}" for k in ("hash", "check", "scan")}
SOURCE_PART_STAGES = (("source:hash", "1", "hash the source (content hash of its files)"),
                      ("source:check", "1", "check the source (config, shapes, tokenizer, formats)"),
                      ("source:scan", "1", "scan every weight for NaN/Inf"))


def job_stages(fits: dict[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """:data:`JOB_STAGES`, its "hash" row replaced by the source's parts when every part has a fit."""
    if not all(g in fits for g, _, _ in SOURCE_PART_STAGES):
        return JOB_STAGES
    return tuple(x for row in JOB_STAGES for x in (SOURCE_PART_STAGES if row[0] == "hash" else (row,)))


@dataclass(frozen=True)
class GpuMeasured:
    """The reference stage measured on a GPU by bench/gpu_reference.py (``--gpu FILE``): what of the GPU column is
    measured rather than assumed. ``host_s_per_entry``: the scoring loop's seconds per stored distribution entry
    (scored positions × vocabulary; the median over the sizes: the loop did not grow with the model there);
    ``start_s``: the stage's start and load at the smallest size (interpreter, torch and CUDA start, weights from
    the page cache)."""

    machine: str
    source: str
    params: tuple[float, ...]
    host_s_per_entry: float
    start_s: float
    rows: tuple[dict[str, Any], ...] = ()

    @classmethod
    def load(cls, path: Path) -> GpuMeasured:
        """Raises SystemExit naming the file when it holds no measured size."""
        data = json.loads(path.read_text())
        rows = [r for r in data.get("rows", []) if r.get("device", "cuda") != "cpu"]
        if not rows:
            raise SystemExit(f"--gpu {path}: no GPU measurement in it (expected rows from bench/gpu_reference.py)")
        per_entry = sorted(r["eval_s"] / (r["scored"] * r["vocab"]) for r in rows)
        smallest = min(rows, key=lambda r: r["params"])
        return cls(machine=data["machine"]["gpu"], source=str(path), params=tuple(r["params"] for r in rows),
                   host_s_per_entry=per_entry[len(per_entry) // 2], start_s=smallest["load_and_start_s"],
                   rows=tuple(rows))

    def describe(self) -> str:
        return (f"MEASURED on {self.machine} ({self.source}, {len(self.params)} sizes, "
                f"{min(self.params) / 1e9:.2f}-{max(self.params) / 1e9:.2f} B parameters): the reference's scoring "
                f"loop is the host's work on the stored distribution, {self.host_s_per_entry * 1e9:.1f} ns per entry "
                f"(scored positions × vocabulary), flat in the model's size there, and its start takes "
                f"{self.start_s:.1f} s")


@dataclass(frozen=True)
class GpuModel:
    """The GPU column: assumptions, and where ``measured`` is given (bench/gpu_reference.py), the reference
    stage's measured host work and start in place of the assumption's silence on them."""

    name: str = "1× NVIDIA H200 (141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense BF16)"
    memory_bytes: float = 139 * GIB  # what the lent machine reports as usable
    bandwidth: float = 4.8e12
    peak_flops: float = 989e12
    flops_fraction: float = 0.35
    bandwidth_fraction: float = 0.6
    load_bps: float = 2e9  # weights from local disk into GPU memory
    bytes_per_param: dict[str, float] = field(default_factory=lambda: {"reference": 2.0, "evaluate": 34 / 32})
    measured: GpuMeasured | None = None

    def assumption(self) -> str:
        base = (f"{self.name}; a forward pass over T tokens costs max(2·P·T FLOPs at {self.flops_fraction:.0%} of "
                f"peak, the weights read once per 512-token window at {self.bandwidth_fraction:.0%} of "
                f"{self.bandwidth / 1e12:.1f} TB/s) plus loading the weights from disk at {self.load_bps / 1e9:.0f} "
                "GB/s; reference in bf16 (2 B/param), each variant counted at Q8_0's 34/32 B/param (the largest "
                "type: an upper bound)")
        if self.measured is None:
            return base + "; the host's exact-KLD work and reference file I/O are left out"
        return (base + f". Added from measurements: {self.measured.describe()}; each stage of the column gets that "
                "start and that host time per entry (MEASURED for the reference; for an evaluation ASSUMED equal, "
                "as its exact KLD reads the same entries: not measured on a GPU)")

    def check(self) -> list[str]:
        """The model against the sizes it was measured at (reference stage, measured wall vs this model)."""
        if self.measured is None:
            return []
        out = ["| size | parameters | measured stage s | this model s |", "|---|---:|---:|---:|"]
        for r in self.measured.rows:
            est = gpu_estimate_s(self, "reference", r["params"], r["tokens"], entries=r["scored"] * r["vocab"])
            out.append(f"| {r['size']} | {r['params'] / 1e9:.2f} B | {r['stage_wall_s']:.1f} | {est:.1f} |")
        return out


def gpu_estimate_s(gpu: GpuModel, stage: str, params: float, tokens: int, window: int = 512,
                   entries: int = 0) -> float | None:
    """ESTIMATE (:meth:`GpuModel.assumption`) of one reference or evaluation on the GPU; None for the stages
    that run on the host CPU whatever the machine (hash, conversion, quantization, registration). With
    ``gpu.measured``: plus its measured start and ``entries`` (scored positions × vocabulary) times its measured
    host time per entry."""
    if stage not in gpu.bytes_per_param:
        return None
    weight_bytes = params * gpu.bytes_per_param[stage]
    compute = 2 * params * tokens / (gpu.peak_flops * gpu.flops_fraction)
    reads = weight_bytes * math.ceil(tokens / window) / (gpu.bandwidth * gpu.bandwidth_fraction)
    host = 0.0 if gpu.measured is None else gpu.measured.start_s + entries * gpu.measured.host_s_per_entry
    return weight_bytes / gpu.load_bps + max(compute, reads) + host


@dataclass(frozen=True)
class JobRow:
    what: str
    count: int
    x: float
    time: Extrapolated
    peak: Extrapolated
    fits_ram: bool
    gpu_s: float | None


def job_estimate(fits: dict[str, tuple[LinearFit, LinearFit]], target: Target, job: Job, ram_bytes: float,
                 gpu: GpuModel) -> list[JobRow]:
    """One row per stage group of ``job`` on ``target``: time (count × per-stage fit, EXTRAPOLATED), peak
    memory (EXTRAPOLATED), whether it fits ``ram_bytes``, and the GPU ESTIMATE. ``fits``: group -> (time fit,
    memory fit). Raises KeyError naming a group of :func:`job_stages` that has no fit."""
    rows = []
    for group, many, what in job_stages(fits):
        if group not in fits:
            raise KeyError(f"no fit for stage group {group!r}: expected one of {sorted(fits)}")
        tfit, mfit = fits[group]
        count = job.types if many == "types" else 1
        tokens = job.tokens if group in TOKEN_STAGES else 0
        x = target.params * tokens if group in TOKEN_STAGES else target.params
        peak = extrapolate(mfit, target.params, target.name, "GiB")
        peak = Extrapolated(peak.quantity, peak.target, peak.x, peak.value / GIB, peak.unit, peak.label)
        one = gpu_estimate_s(gpu, group, target.params, tokens, job.window, entries=job.scored * target.vocab)
        rows.append(JobRow(f"{what} ×{count}" if count > 1 else what, count, x,
                           extrapolate(tfit, x, target.name, "s", count), peak,
                           peak.value * GIB <= ram_bytes, None if one is None else count * one))
    return rows


# --- measuring ------------------------------------------------------------------------------------


@dataclass
class StageRun:
    """One stage at one size. ``peak_bytes``: ``memory`` says what it is: ``own`` (since 2026-12-07: the stage's
    own processes, RssAnon + RssShmem, pipeline/resources.py: a memory-mapped model file is not counted, as the
    kernel does not count it against the machine) or ``rss`` (before: the summed RSS of every process of the run,
    mapped files included, an upper bound). ``in_use_bytes``: the machine's memory in use at the stage's peak."""

    seconds: float
    peak_bytes: float | None
    tokens: int
    in_use_bytes: float | None = None
    memory: str = "rss"


@dataclass
class SizeRun:
    size: str
    checkpoint: str
    params: int
    windows: int
    stages: dict[str, StageRun]
    total_s: float
    peak_bytes: float
    synthetic: bool = False
    vocab: int | None = None  # the checkpoint's config.json vocab_size (None in measurements saved before it)


def param_count(ckpt: Path) -> int:
    """Parameters stored in a checkpoint's safetensors files (tied weights once), from their headers."""
    total = 0
    for f in sorted(ckpt.glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def big_checkpoint(cfg: Settings) -> Path:
    """The synthetic ~0.77 B checkpoint (:data:`BIG`), built once under its config hash."""
    import torch
    import transformers

    from pipeline.fs import atomic_path

    real = vs.checkpoint("real", cfg)
    recipe = {"config": BIG, "seed": BIG_SEED, "copied_from": real.name, "transformers": transformers.__version__,
              "torch": torch.__version__}
    final = cfg.cache_dir / "synthetic" / hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    if (final / "quantyard-synthetic.json").exists():
        return final
    print(f"[big] building the synthetic checkpoint in {final} (once) ...", file=sys.stderr, flush=True)
    torch.manual_seed(BIG_SEED)
    config: Any = transformers.LlamaConfig(**BIG)  # type: ignore[arg-type]  # BIG holds ints and floats by name
    model: Any = transformers.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    with atomic_path(final) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        for name in BIG_COPIED:
            if (real / name).exists():
                shutil.copy2(real / name, staging / name)
        note = "SYNTHETIC: random weights (fixed seed); costs are real, PPL/KLD meaningless"
        (staging / "quantyard-synthetic.json").write_text(json.dumps({**recipe, "note": note}, indent=1))
    return final


def size_checkpoint(size: str, cfg: Settings) -> Path:
    """demo, real, big, 8b (bench/synthetic.py's Llama-3-8B shape), or a local checkpoint folder by its path
    (SystemExit when it is not one)."""
    return big_checkpoint(cfg) if size == "big" else vs.checkpoint(size, cfg)


def vocab_size(ckpt: Path) -> int | None:
    """config.json's vocab_size (a multimodal config's text_config's), or None when it names none."""
    cfg = json.loads((ckpt / "config.json").read_text())
    v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(v) if v else None


class RssSampler(threading.Thread):
    """Samples (monotonic time, summed RSS of this process's descendants) every ``period`` s until stopped."""

    def __init__(self, period: float = SAMPLE_S) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.samples: list[tuple[float, int]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil  # type: ignore[import-untyped]

        me = psutil.Process()
        while not self._stop_event.is_set():
            rss = 0
            for p in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):  # gone between listing and reading
                    rss += p.memory_info().rss
            self.samples.append((time.monotonic(), rss))
            self._stop_event.wait(self.period)

    def stop(self) -> list[tuple[float, int]]:
        self._stop_event.set()
        self.join()
        return self.samples


def intervals(events: list[vs.Event], ckpt: Path) -> dict[str, tuple[float, float]]:
    """Stage -> (start, end) monotonic times from the child's progress log; ``hash`` is the source's
    resolve event and ``source:*`` its parts (:data:`SOURCE_PARTS`; of a part run twice, e.g. the hash by the
    ledger's check and by the resolve, the longer run), the others are named like the report's stages (less an
    evaluation's engine)."""
    starts: dict[str, float] = {}
    out: dict[str, tuple[float, float]] = {}
    for t, stage, detail, phase in events:
        if detail == str(ckpt) and stage in SOURCE_PARTS:
            key = SOURCE_PARTS[stage]
        else:
            key = "hash" if (stage, detail) == ("resolve", str(ckpt)) else f"{stage}:{detail}" if detail else stage
        if phase == "start":
            starts[key] = t
        elif key in starts:
            span = (starts.pop(key), t)
            if key not in out or span[1] - span[0] > out[key][1] - out[key][0]:  # a part run twice: its longer run
                out[key] = span
    return out


def peak_in(samples: list[tuple[float, int]], span: tuple[float, float] | None) -> float | None:
    """The largest sample within ``span``; a stage shorter than a sample period gets the last one before
    its end. None without a span or a sample."""
    if span is None:
        return None
    inside = [rss for t, rss in samples if span[0] <= t <= span[1]]
    before = [rss for t, rss in samples if t <= span[1]]
    return float(max(inside)) if inside else float(before[-1]) if before else None


def peak_outside(samples: list[tuple[float, int]], spans: dict[str, tuple[float, float]]) -> float | None:
    """The largest sample outside every span: the command's own work between and around its stages."""
    out = [rss for t, rss in samples if not any(a <= t <= b for a, b in spans.values())]
    return float(max(out)) if out else None


def measure(size: str, ckpt: Path, cfg: Settings, windows: int, threads: int,
            reference: str = "llama.cpp") -> SizeRun:
    """One ``quantyard convert`` run of ``ckpt`` on a fresh registry, cache and work dir, sampled.
    Raises RuntimeError when it fails or a stage did not run."""
    cfg.work_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cfg.work_root, prefix="bench-scaling-") as tmp:
        work = Path(tmp)
        events = work / "events.jsonl"
        text, _ = vs.eval_text_file(ckpt, None, work / "text")
        flags = ["--name", "bench", "--gguf", ",".join(vs.QUANTS), "--gguf-base", "f16", "--eval-text",
                 str(text), "--window", str(vs.CTX), "--stride", str(vs.CTX), "--score-from",
                 str(vs.SCORE_FROM), "--max-windows", str(windows), "--threads", str(threads),
                 "--registry", str(work / "registry"), "--reference-engine", reference, "--no-speed",
                 "--no-noise-floor", "--json"]
        cmd = [sys.executable, "-c", vs.CHILD, str(events), "convert", str(ckpt), *flags]
        sampler = RssSampler()
        sampler.start()
        t0 = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, env=vs.fresh_env(cfg, work), cwd=vs.REPO)
        finally:
            samples = sampler.stop()
        total = time.perf_counter() - t0
        if res.returncode != 0:
            raise RuntimeError(f"quantyard convert exited {res.returncode}: {(res.stdout + res.stderr)[-3000:]}")
        logged = vs.read_events(events)  # read once for both summaries
        spans = intervals(logged, ckpt)
        # the source's resolve parts; its hashing when the ledger's check did it first (before the resolve event)
        parts, pinned = vs.resolve_parts(logged, str(ckpt))
    report = json.loads(res.stdout)
    n_windows = int((report.get("window_set") or {}).get("n_windows") or windows)
    stages = {"hash": StageRun(spans["hash"][1] - spans["hash"][0] + pinned, peak_in(samples, spans["hash"]), 0)}
    for event, part in SOURCE_PARTS.items():  # inside "hash": shown and fitted, not counted twice in "other"
        if event in parts:
            stages[part] = StageRun(parts[event], peak_in(samples, spans.get(part)), 0)
    for entry in report["stages"]:
        name = entry["stage"]
        if entry["status"] != "ran":
            raise RuntimeError(f"stage {name} {entry['status']} in a fresh run: {entry.get('error')}")
        short = ":".join(name.split(":")[:2])
        tokens = n_windows * vs.CTX if short.startswith(TOKEN_STAGES) else 0
        usage = entry.get("usage") or {}
        own = usage.get("peak_process_bytes")  # the stage's own processes, mapped files not counted
        stages[short] = StageRun(float(entry["dispatch_s"] or 0.0),
                                 own if own is not None else peak_in(samples, spans.get(short)), tokens,
                                 usage.get("peak_in_use_bytes"), "own" if own is not None else "rss")
    # what no stage holds: interpreter start, imports, Prefect's embedded server, registry, report, JSON
    counted = sum(s.seconds for k, s in stages.items() if k not in SOURCE_PARTS.values())
    stages["other"] = StageRun(total - counted, peak_outside(samples, spans), 0)
    return SizeRun(size, str(ckpt), param_count(ckpt), n_windows, stages, total,
                   float(max((r for _, r in samples), default=0)), synthetic=size in SYNTHETIC_SIZES,
                   vocab=vocab_size(ckpt))


# --- from measurements to fits --------------------------------------------------------------------


def groups(run: SizeRun) -> dict[str, StageRun]:
    """Every measured stage, plus per-type groups (``build``, ``register``, ``evaluate``): the mean time over
    the types and the largest peak."""
    out = dict(run.stages)
    for kind in PER_TYPE:
        mine = [s for k, s in run.stages.items() if k.startswith(kind + ":")]
        if mine:
            peaks = [s.peak_bytes for s in mine if s.peak_bytes is not None]
            out[kind] = StageRun(sum(s.seconds for s in mine) / len(mine), max(peaks) if peaks else None,
                                 mine[0].tokens)
    return out


def fit_groups(runs: list[SizeRun]) -> tuple[dict[str, tuple[LinearFit, LinearFit]], dict[str, str]]:
    """(group -> (time fit, memory fit), group -> why it has none) over the sizes measured."""
    per_size = [(run.params, groups(run)) for run in runs]
    names = list(dict.fromkeys(k for _, g in per_size for k in g))
    fits, missing = {}, {}
    for name in names:
        pts = [(p, g[name]) for p, g in per_size if name in g]
        token = name.startswith(TOKEN_STAGES)
        try:
            tfit = fit_line([p * (s.tokens if token else 1) for p, s in pts], [s.seconds for _, s in pts],
                            f"time of {name}", "P·T" if token else "P")
            mem = [(p, s.peak_bytes) for p, s in pts if s.peak_bytes is not None]
            mfit = fit_line([p for p, _ in mem], [b for _, b in mem], f"peak memory of {name}", "P")
        except UnderdeterminedFitError as exc:
            missing[name] = str(exc)
            continue
        fits[name] = (tfit, mfit)
    return fits, missing


# --- the report -----------------------------------------------------------------------------------


def _num(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"


def _gib(v: float | None) -> str:
    return "—" if v is None else f"{v / GIB:.2f}"


def measured_table(run: SizeRun) -> str:
    kind = ("SYNTHETIC (random weights: costs real, PPL/KLD meaningless)" if run.synthetic
            else "pretrained" if run.size in SIZES else "a local checkpoint")
    vocab = "" if run.vocab is None else f", vocabulary {run.vocab:,}"
    own = any(s.memory == "own" for s in run.stages.values())
    memory = "peak own memory GiB | machine in use GiB" if own else "peak RSS GiB | machine in use GiB"
    out = [f"### {run.size}: {run.params / 1e6:.1f} M parameters{vocab}, {kind}; {run.windows} windows × {vs.CTX} "
           "tokens",
           f"checkpoint {run.checkpoint}", "", f"| stage | seconds | {memory} | tokens |", "|---|---:|---:|---:|---:|"]
    out += [f"| {k} | {s.seconds:.2f} | {_gib(s.peak_bytes)} | {_gib(s.in_use_bytes)} | {s.tokens} |"
            for k, s in run.stages.items()]
    out.append(f"| **whole command** | **{run.total_s:.1f}** | **{_gib(run.peak_bytes)}** (summed RSS) | | |")
    return "\n".join(out)


def fit_table(fits: dict[str, tuple[LinearFit, LinearFit]], missing: dict[str, str], runs: list[SizeRun]) -> str:
    sizes = "/".join(r.size for r in runs)
    out = ["### Fits (least squares over the measured sizes)", "",
           f"| stage | time model | a s | b s per x | time residuals s ({sizes}) | memory c GiB | d B/param "
           f"| memory residuals GiB ({sizes}) |", "|---|---|---:|---:|---|---:|---:|---|"]
    for name, (t, m) in fits.items():
        tres = ", ".join(f"{r:+.2f}" for r in t.residuals())
        mres = ", ".join(f"{r / GIB:+.2f}" for r in m.residuals())
        out.append(f"| {name} | a + b·{t.x_name} | {t.a:.3g} | {t.b:.3e} | {tres} | {m.a / GIB:.3g} | {m.b:.3g} "
                   f"| {mres} |")
    if not fits:
        out = out[:1]
    reasons: dict[str, list[str]] = {}
    for name, why in missing.items():
        reasons.setdefault(why.split(": ", 1)[1], []).append(name)
    out += [f"- not fitted: {', '.join(names)}: {why}" for why, names in reasons.items()]
    out.append("- x: P = parameters stored (tied weights once), T = tokens run; the demo checkpoint is fp32 on disk "
               "(4 B/param), real and big are bf16 (2 B/param), which the memory line does not separate")
    return "\n".join(out)


def job_table(fits: dict[str, tuple[LinearFit, LinearFit]], target: Target, job: Job, ram: float,
              gpu: GpuModel) -> str:
    rows = job_estimate(fits, target, job, ram, gpu)
    out = [f"### {target.name}: {target.params / 1e9:.1f} B parameters — EXTRAPOLATED, not measured",
           f"Job: F16 base + {job.types} GGUF types, reference + evaluation of each on {job.windows} windows × "
           f"{job.window} = {job.tokens:,} tokens run ({job.scored:,} scored).", "",
           f"| stage | CPU time, this machine (EXTRAPOLATED) | peak RSS (EXTRAPOLATED) | fits {ram / GIB:.0f} GiB RAM? "
           "| GPU s: ESTIMATE, see assumption |", "|---|---|---|---|---|"]
    for r in rows:
        gpu_s = "host CPU stage: no GPU estimate" if r.gpu_s is None else f"{r.gpu_s:.3g} s (ESTIMATE)"
        out.append(f"| {r.what} | {r.time} | {r.peak} | {'yes' if r.fits_ram else '**NO**'} | {gpu_s} |")
    total = sum(r.time.value for r in rows)
    gpu_total = sum(r.gpu_s for r in rows if r.gpu_s is not None)
    out.append(f"| **whole job** | **{_num(total)} s = {total / 3600:.3g} h (EXTRAPOLATED)** | "
               f"{_num(max(r.peak.value for r in rows))} GiB (EXTRAPOLATED) | | reference + evaluations: "
               f"{gpu_total:.3g} s (ESTIMATE) |")
    too_big = [r.what for r in rows if not r.fits_ram]
    out += ["", f"- would not fit this machine's RAM (EXTRAPOLATED): {', '.join(too_big) or 'none'}",
            f"- disk (ESTIMATE, {disk_note(target, job)})",
            f"- GPU memory (ESTIMATE): bf16 reference weights {2 * target.params / GIB:.0f} GiB of "
            f"{gpu.memory_bytes / GIB:.0f} GiB ({'fits' if 2 * target.params < gpu.memory_bytes else 'does NOT fit'}"
            "; activations and logits need room beyond that)",
            f"- stored reference distribution (computed from evaluators/reference.py's format, 2 B per vocabulary "
            f"entry per scored position + 8, vocabulary {target.vocab:,}): "
            f"{(2 * target.vocab + 8) * job.scored / 1e9:.1f} GB; the fits above saw 49,152 entries at most"]
    return "\n".join(out)


def disk_note(target: Target, job: Job) -> str:
    """The job's files on disk, from each GGUF type's bits (converters/gguf/converter.py ``estimated_bytes``, the
    pre-flight's own estimate) and the stored reference's format."""
    from converters.gguf.converter import estimated_bytes
    from pipeline.footprint import ModelFacts

    hidden = 8192 if target.params > 20e9 else 4096
    facts = ModelFacts(n_params=int(target.params), stored_bytes=int(2 * target.params), dtype="bfloat16",
                       vocab=target.vocab, hidden=hidden, layers=0, kv_width=0, intermediate=0, largest=0,
                       embedding_params=2 * target.vocab * hidden)
    base = estimated_bytes(facts, "F16")
    types = {t: estimated_bytes(facts, t) for t in job.type_names}
    store = (2 * target.vocab + 8) * job.scored
    total = base + sum(types.values()) + store
    parts = ", ".join(f"{t} {b / 1e9:.0f}" for t, b in types.items())
    return (f"{total / 1e9:,.0f} GB in all: the F16 base {base / 1e9:.0f}, the six types {parts}, the stored "
            f"reference {store / 1e9:.1f}; a registry on another filesystem holds the same again, on one "
            "filesystem the blob store links the files")


def header(argv: list[str], load: tuple[float, float, float], threads: int) -> str:
    """Command, commit, CPU model and ISA flags, RAM, load average at start (warned above 1.5), date."""
    code = ("pipeline", "flows", "converters", "evaluators", "registry", "bench/scaling.py",
            "bench/pipeline_vs_llamacpp.py")
    dirty = " (with uncommitted changes)" if vs._git("status", "--porcelain", "--", *code) else ""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), platform.processor())
    out = [f"# command: python {' '.join(argv)}",
           f"# commit: {vs._git('rev-parse', '--short', 'HEAD')}{dirty}",
           f"# CPU: {cpu}, {os.cpu_count()} cores, ISA flags: {cpu_flags()}; threads {threads}; "
           f"RAM {ram_bytes() / GIB:.1f} GiB",
           f"# load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min)",
           f"# date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}"]
    if load[0] > 1.5:
        out.append(f"# WARNING: load average {load[0]:.2f} > 1.5 at start: other work shares the CPUs, times are high")
    return "\n".join(out)


def ram_bytes() -> float:
    import psutil

    return float(psutil.virtual_memory().total)


def report(runs: list[SizeRun], ram: float, gpu: GpuModel, job: Job) -> list[str]:
    """The measured tables, the fits, and each target's EXTRAPOLATED job (when every job stage has a fit)."""
    parts = [measured_table(r) for r in runs]
    fits, missing = fit_groups(runs)
    parts.append(fit_table(fits, missing, runs))
    absent = [g for g, _, _ in JOB_STAGES if g not in fits]
    if absent:
        parts.append(f"No extrapolation: no fit for {', '.join(absent)} (measure at least two sizes).")
        return parts
    text = "## EXTRAPOLATED to larger models (from the fits above; nothing below was measured)\n\n"
    if gpu.measured is None:
        text += f"GPU column: ESTIMATE, no GPU measurement exists. Assumption: {gpu.assumption()}."
    else:
        text += (f"GPU column: ESTIMATE, in part from a GPU measurement. Assumption: {gpu.assumption()}.\n\n"
                 "The GPU column's reference, at the sizes it was measured at:\n\n" + "\n".join(gpu.check()))
    parts.append(text)
    parts += [job_table(fits, t, job, ram, gpu) for t in TARGETS]
    return parts


def load_runs(path: Path) -> list[SizeRun]:
    """Measurements saved with ``--save``."""
    return [SizeRun(**{**d, "stages": {k: StageRun(**s) for k, s in d["stages"].items()}})
            for d in json.loads(path.read_text())]


def compare_table(old: list[SizeRun], new: list[SizeRun], source: Path) -> str:
    """How far the fits of ``old`` (an earlier measurement file) were off at each size of ``new`` beyond their
    largest measured size: per stage group, the old EXTRAPOLATION and the measurement, time and memory (memory only
    where both measured the same thing: the stage's own memory, or both summed RSS)."""
    fits, _ = fit_groups(old)
    top = max(r.params for r in old)
    beyond = [r for r in new if r.params > top]
    out = [f"### The earlier fits ({source.name}: {', '.join(f'{r.size} {r.params / 1e9:.2f} B' for r in old)}) "
           "against the sizes measured here beyond them", ""]
    if not beyond:
        return "\n".join([*out, "- no size measured here is larger than the earlier file's largest"])
    for run in beyond:
        out += [f"#### {run.size}: {run.params / 1e9:.2f} B parameters, measured",
                "", "| stage | EXTRAPOLATED s (earlier fit) | measured s | measured / extrapolated "
                "| EXTRAPOLATED peak GiB | measured peak GiB |", "|---|---:|---:|---:|---:|---:|"]
        for name, stage in groups(run).items():
            if name not in fits:
                continue
            tfit, mfit = fits[name]
            x = run.params * (stage.tokens if name.startswith(TOKEN_STAGES) else 1)
            t = tfit.predict(x)
            same = {s.memory for o in old for k, s in groups(o).items() if k == name} == {stage.memory}
            m = f"{mfit.predict(run.params) / GIB:.2f}" if same else "— (measured otherwise)"
            ratio = f"{stage.seconds / t:.2f}" if t > 0 else "—"
            out.append(f"| {name} | {t:.1f} | {stage.seconds:.1f} | {ratio} | {m} | {_gib(stage.peak_bytes)} |")
        out.append("")
    return "\n".join(out)


def parse_windows(text: str | None, sizes: list[str]) -> dict[str, int]:
    """``--windows``: one number for every size, or one per size in ``--sizes`` order; default per size."""
    if text is None:
        return {s: DEFAULT_WINDOWS.get(s, FOLDER_WINDOWS) for s in sizes}
    vals = [int(v) for v in text.split(",")]
    if len(vals) == 1:
        return dict.fromkeys(sizes, vals[0])
    if len(vals) != len(sizes):
        raise SystemExit(f"--windows: expected 1 or {len(sizes)} comma-separated numbers, got {len(vals)}")
    return dict(zip(sizes, vals, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(DEFAULT_SIZES),
                    help="comma-separated: demo, real, big, 8b (SYNTHETIC, Llama-3-8B's shape: about an hour), or a "
                         "local checkpoint folder (default demo,real,big)")
    ap.add_argument("--windows", default=None, help="512-token windows: N, or one per size (default 16,16,8)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reference", choices=("llama.cpp", "transformers"), default="llama.cpp",
                    help="the reference engine (default llama.cpp: the F16 GGUF, the one that scales)")
    ap.add_argument("--out", type=Path, default=None, help="also write the report, with its header, here")
    ap.add_argument("--save", type=Path, default=None, help="write the raw measurements (JSON) here")
    ap.add_argument("--load", type=Path, action="append", default=None,
                    help="fit saved measurements instead of measuring (repeatable: the files' sizes together)")
    ap.add_argument("--compare", type=Path, default=None,
                    help="an earlier measurement file: its fits' EXTRAPOLATION to each size measured here beyond its "
                         "range, against what was measured (how far the old extrapolation was off)")
    ap.add_argument("--gpu", type=Path, default=None,
                    help="the reference stage measured on a GPU (bench/gpu_reference.py's JSON) for the GPU column")
    args = ap.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:  # a mistyped folder fails now, before minutes of building and measuring
        if s not in SIZES:
            vs.checkpoint_folder(s, option="--sizes", builtin="demo, real, big, 8b")
    cfg = Settings(threads=args.threads)
    windows = parse_windows(args.windows, sizes)
    # built (the synthetic one: once, minutes) before the load average is read and anything is timed
    ckpts = {} if args.load is not None else {size: size_checkpoint(size, cfg) for size in windows}
    parts = [header(sys.argv, os.getloadavg(), args.threads)]
    print(parts[0] + "\n", flush=True)
    if args.load is not None:
        runs = [r for path in args.load for r in load_runs(path)]
    else:
        runs = []
        for size, ckpt in ckpts.items():
            print(f"[{size}] quantyard convert, {windows[size]} windows ...", file=sys.stderr, flush=True)
            runs.append(measure(size, ckpt, cfg, windows[size], args.threads, args.reference))
        if args.save is not None:
            args.save.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    gpu = GpuModel(measured=GpuMeasured.load(args.gpu) if args.gpu is not None else None)
    parts += report(runs, ram_bytes(), gpu, Job())
    if args.compare is not None:
        parts.append(compare_table(load_runs(args.compare), runs, args.compare))
    end = os.getloadavg()
    parts.append(f"# load average at end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f} (1/5/15 min)")
    for p in parts[1:]:
        print(p + "\n", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
