"""Serving under load, measured: the real checkpoint's Q4_K_M on llama-server and its AWQ on vLLM's OpenAI server,
each loaded by GuideLLM through Quantyard (evaluators/serving/load.py) at 1, 8 and 32 users, and the client's
overhead: Quantyard + GuideLLM's TTFT against the same requests sent one at a time by curl.

Usage: python bench/serving.py [--registry DIR] [--out FILE] [--users 1,8,32] [--requests N] [--curl N]

* The checkpoint is SmolLM2-135M-Instruct built offline (pipeline/real_model.py; its weights are dequantized
  from a Q4_1 GGUF). The two variants are converted once with ``quantyard convert --no-eval`` into
  ``--registry`` (default: CACHE_DIR/bench/serving-registry) and reused afterwards.
* Load: the closed-loop ``cpu-scaled`` profile on a CPU (128 prompt / 32 output tokens, warm-up excluded,
  evaluators.serving.load.cpu_profile), the seed profile with a GPU; one server per variant with as many
  slots as the largest user count, prompt caching off (evaluators/serving/server.py).
* Client overhead: the first ``--curl`` request bodies GuideLLM sent at 1 user (its report keeps them) are sent
  again, one at a time, by ``curl --no-buffer --trace-ascii - --trace-time``; curl's TTFT is the time from
  sending the request header to receiving the first data block with a non-empty ``text``. The ratio is the
  median TTFT Quantyard + GuideLLM measured at 1 user over curl's median on the same bodies and server.

Prints the table and writes it, with a header (command, commit, CPU flags, load), to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from evaluators.serving.load import cpu_profile, run_load, seed_profile
from evaluators.serving.server import start_server
from evaluators.serving.spec import ServerSpec
from flows.steps import real_checkpoint
from pipeline.config import Settings
from pipeline.cpu import cpu_flags
from pipeline.envs import detect_accelerator
from pipeline.serving import LevelStats, LoadProfile
from pipeline.specs import Engine
from registry import open_registry

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
GGUF_TYPE = "Q4_K_M"
#: Slack on each request's context: the server's tokenizer may count a few more prompt tokens (BOS, splits).
CONTEXT_SLACK = 64
_TRACE = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) (=>|<=|==) (.*)$")


def ensure_variants(registry: Path, checkpoint: Path, files: Path) -> dict[Engine, Path]:
    """The Q4_K_M GGUF file and the AWQ folder, converted (no evaluation) unless the registry has them, linked
    under ``files``."""
    reg = open_registry(str(registry), create=not registry.exists())
    have = {(v.format, v.variant if v.format == "gguf" else "") for v in reg.latest_versions(MODEL)}
    if not {("gguf", GGUF_TYPE), ("awq", "")} <= have:
        subprocess.run([sys.executable, "-m", "pipeline.cli", "convert", str(checkpoint), "--name", MODEL,
                        "--gguf", GGUF_TYPE, "--awq", "--no-eval", "--registry", str(registry)], check=True)
        reg = open_registry(str(registry))
    latest = reg.latest_versions(MODEL)
    views = {"gguf": next(v for v in latest if v.variant == GGUF_TYPE),
             "awq": next(v for v in latest if v.format == "awq")}
    gguf_dir, awq_dir = files / views["gguf"].variant, files / views["awq"].variant
    if not gguf_dir.exists():
        reg.link_files(f"{MODEL}/{views['gguf'].variant}", gguf_dir)
    if not awq_dir.exists():
        reg.link_files(f"{MODEL}/{views['awq'].variant}", awq_dir)
    (gguf,) = sorted(gguf_dir.glob("*.gguf"))
    return {Engine.LLAMA_CPP: gguf, Engine.VLLM: awq_dir}


def curl_ttft_ms(url: str, body: dict[str, Any]) -> float:
    """One streamed request timed by curl's own trace: request header sent → first data with non-empty text.

    Raises:
        RuntimeError: curl failed or no text arrived.
    """
    res = subprocess.run(["curl", "-sS", "--no-buffer", "--trace-ascii", "-", "--trace-time", "-o", "/dev/null",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body), url],
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"curl failed ({res.returncode}): {res.stderr[-500:]}")
    sent, block_t, block = None, None, []
    for line in [*res.stdout.splitlines(), "00:00:00.0 == end"]:
        m = _TRACE.match(line)
        if not m:
            block.append(line.split(": ", 1)[-1])
            continue
        if block_t is not None and re.search(r'"text"\s*:\s*"[^"]', "".join(block)):
            return 1000.0 * (block_t - (sent or block_t))
        t = int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])
        if m[4] == "=>" and m[5].startswith("Send header") and sent is None:
            sent = t
        block_t, block = (t, []) if m[4] == "<=" and m[5].startswith("Recv data") else (None, [])
    raise RuntimeError("curl received no text")


def sent_bodies(level_dir: Path, n: int) -> list[dict[str, Any]]:
    """The first ``n`` request bodies GuideLLM sent at this level (its report keeps each request's arguments)."""
    report = json.loads((level_dir / "guidellm-report.json").read_text())
    stats = report["benchmarks"][0]["requests"]["successful"]
    stats.sort(key=lambda s: s["info"]["timings"]["request_start"])
    return [json.loads(s["request_args"])["body"] for s in stats[:n] if s.get("request_args")]


def serve_and_load(engine: Engine, model: Path, tokenizer: Path, profile: LoadProfile, settings: Settings,
                   out: Path, n_curl: int) -> dict[str, Any]:
    """Start the variant's server, run the profile, then time the same bodies with curl; returns the row."""
    spec = ServerSpec(engine=engine, model=model, slots=max(profile.concurrencies),
                      context=profile.prompt_tokens + profile.output_tokens + CONTEXT_SLACK, start_timeout_s=900)
    with start_server(spec, settings, out / "logs") as srv:
        levels = run_load(srv.base_url, srv.model_name, tokenizer, profile, settings, out / "load",
                          on_level=lambda lv: print(f"  {engine} {lv.concurrency} users: {_cells(lv)}", flush=True),
                          sampler=srv)
        first = next(d for d in sorted((out / "load").iterdir()) if d.name.endswith("-c1"))
        curl = [curl_ttft_ms(f"{srv.base_url}/v1/completions", b) for b in sent_bodies(first, n_curl)]
        info = srv.info
        memory = srv.memory_info()
    ours = [r.t_first - r.t_sent for r in levels[0].requests_log if r.t_first is not None and r.error is None]
    return {"engine": str(engine), "server": f"{info.server} {info.version}", "levels": levels,
            "curl_ms": curl, "ours_c1_ms": [1000.0 * x for x in ours], "memory": memory}


def _cells(lv: LevelStats) -> str:
    ttft = lv.ttft_ms
    p50, p99 = (f"{ttft.median:9.1f}", f"{ttft.p99:9.1f}") if ttft else ("—", "—")
    tok = f"{lv.output_throughput:9.1f}" if lv.output_throughput is not None else "—"
    rss = f"{lv.rss_peak_bytes / 2**20:9.0f}" if lv.rss_peak_bytes else f"{'—':>9}"
    return f"{p50} {p99} {tok} {lv.completed:>4}/{lv.requests:<4} {lv.failed:>3} {rss}"


def _mib(x: int | None) -> str:
    return "—" if x is None else f"{x / 2**20:.1f} MiB"


def table(rows: list[dict[str, Any]], profile: LoadProfile) -> list[str]:
    out = [f"{'variant / server':<44} {'users':>5} {'p50 TTFT':>9} {'p99 TTFT':>9} {'out tok/s':>9} "
           f"{'done/req':>9} {'fail':>3} {'peak RSS MiB':>9}"]
    for row in rows:
        for lv in row["levels"]:
            out.append(f"{row['name'][:44]:<44} {lv.concurrency:>5} {_cells(lv)}")
    out.append("")
    out.append("memory, measured (RSS: the sum over the server's processes, sampled every 100 ms; shared pages "
               "count once per process, so for vLLM's several processes it overstates)")
    for row in rows:
        m = row["memory"]
        kv = f"{_mib(m.kv_cache_bytes)} for {m.kv_cache_tokens} tokens" if m.kv_cache_bytes else "not reported"
        out.append(f"  {row['name'][:44]:<44} weights {_mib(m.weights_bytes)}, "
                   f"after load {_mib(m.rss_after_load_bytes)}, peak {_mib(m.rss_peak_bytes)}; "
                   f"KV cache {kv} ({m.concurrency} slots × {m.context} tokens asked)")
    out.append("")
    out.append("client overhead at 1 user (same server, same request bodies, one at a time): median TTFT ms")
    for row in rows:
        ours, curl = statistics.median(row["ours_c1_ms"]), statistics.median(row["curl_ms"])
        out.append(f"  {row['name'][:44]:<44} Quantyard+GuideLLM {ours:8.1f} (n={len(row['ours_c1_ms'])})  "
                   f"curl {curl:8.1f} (n={len(row['curl_ms'])})  ratio {ours / curl:.3f}")
    out.append("")
    out.append(f"profile: {profile.name}, {profile.prompt_tokens} prompt / {profile.output_tokens} output tokens, "
               f"{profile.requests_per_level} measured requests per level after {profile.warmup_requests} warm-up, "
               f"temperature {profile.temperature}, ignore_eos, timeout {profile.timeout_s:g} s; {profile.note or ''}")
    return out


def header(argv: list[str], settings: Settings) -> list[str]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")  # stripped: the first line lost its status column
    changed = " ".join(line.split(maxsplit=1)[-1] for line in dirty.splitlines())
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    return [f"# python bench/serving.py {shlex.join(argv)}",
            f"# commit {git('rev-parse', '--short', 'HEAD')}"
            f"{f' (uncommitted changes in: {changed})' if changed else ''}, {time.strftime('%Y-%m-%d %H:%M %Z')}",
            f"# machine: {cpu}, {os.cpu_count()} cores, server threads {settings.threads}; ISA flags: {cpu_flags()}",
            f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
            "# real checkpoint: SmolLM2-135M-Instruct, weights dequantized from a Q4_1 GGUF (pipeline/real_model.py)"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--registry", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serving.txt")
    ap.add_argument("--users", default="1,8,32")
    ap.add_argument("--requests", type=int, default=None, help="measured requests per level (profile default)")
    ap.add_argument("--curl", type=int, default=8, help="requests timed by curl per server")
    args = ap.parse_args()
    settings = Settings()
    gpu = detect_accelerator(settings) == "cuda"
    base = seed_profile() if gpu else cpu_profile()
    update: dict[str, Any] = {"concurrencies": [int(u) for u in args.users.split(",")]}
    if args.requests:
        update["requests_per_level"] = args.requests
    profile = base.model_copy(update=update)
    lines = header(sys.argv[1:], settings)
    checkpoint = real_checkpoint(settings)
    registry = args.registry or settings.cache_dir / "bench" / "serving-registry" / "registry"
    work = settings.work_root / "bench-serving" / time.strftime("%Y%m%dT%H%M%S")
    models = ensure_variants(registry, checkpoint, work / "served")
    rows = []
    for engine, model in models.items():
        print(f"{engine}: {model}", flush=True)
        row = serve_and_load(engine, model, checkpoint, profile, settings, work / str(engine), args.curl)
        row["name"] = f"{model.stem if model.is_file() else model.name} / {row['server']}"
        rows.append(row)
    lines += table(rows, profile)
    lines.append(f"# files: {work}")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
