"""Web listing latency on a registry of 10,000 SYNTHETIC variants (target: model page p95 < 100 ms).

    python bench/web_load.py [--models 50] [--variants 200] [--requests 200] [--registry DIR] [--fill api|bulk]

The registry holds ``models × variants`` variants (default 50 × 200 = 10,000), each with one version, one
file (a real blob with synthetic bytes), a quality and a speed result whose numbers are SYNTHETIC (a smooth
function of bits per weight, not measurements), ``latest`` and, on some, a named alias.

* The measured model (``bench/model-000``, the first) is registered through the real Registry API
  (``register_version``, ``add_result``, ``set_alias``), exactly as the flow writes it.
* The others are bulk-inserted with SQLAlchemy Core into the same tables (``--fill bulk``, the default:
  seconds instead of ~50 ms per variant), with the same rows the API writes: blob, version file,
  lineage edges, results, ``latest`` alias and audit events. ``--fill api`` registers every one of them
  through the API instead (about 10 minutes for 10,000).

Then ``quantyard serve`` runs in a second process and this process requests, sequentially over one
keep-alive connection on loopback, each page or endpoint ``--requests`` times after a warm-up, and prints
p50 / p95 / max latency in milliseconds.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.specs import SourceKind, SourceRef
from registry import open_registry, sql
from registry.store import RegisterRequest, Registry

SOURCE = SourceRef(kind=SourceKind.HUB, path="/synthetic", repo_id="bench/synthetic", revision="main",
                   commit="5e" * 20)
TOOL = {"name": "bench-synthetic", "version": "1"}
GGUF = ("Q2_K", "Q3_K_M", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16")
GGUF_BPW = {"Q2_K": 2.6, "Q3_K_M": 3.9, "Q4_0": 4.5, "Q4_K_M": 4.85, "Q5_K_M": 5.7, "Q6_K": 6.6, "Q8_0": 8.5,
            "F16": 16.0}
WINDOW_SET = "77" * 32


def variant_plan(i: int) -> tuple[str, str, dict[str, Any], float]:
    """(name, format, spec, bpw) of synthetic variant ``i``."""
    kind = i % 5
    if kind < 3:
        t = GGUF[i % len(GGUF)]
        return f"{t}-{i:04d}", "gguf", {"format": "gguf", "type": t, "imatrix": i % 2 == 0}, GGUF_BPW[t]
    if kind == 3:
        return f"AWQ-W4-G128-{i:04d}", "awq", {"format": "awq", "bits": 4, "group_size": 128}, 4.25
    bpw = 2.5 + (i % 12) * 0.5
    return f"EXL2-{bpw:.1f}bpw-{i:04d}", "exl2", {"format": "exl2", "bpw": bpw, "head_bits": 6}, bpw


def synthetic_results(bpw: float, engine: str, rng: random.Random) -> list[dict[str, Any]]:
    """SYNTHETIC quality and speed figures: smooth in bpw plus noise; not measurements."""
    kld = 0.5 * math.exp(-1.1 * bpw) * rng.uniform(0.8, 1.25)
    ppl = 8.0 * (1 + 2 * kld)
    base = {"engine": engine, "engine_version": "synthetic", "status": "ok", "hardware": {"synthetic": True}}
    return [
        {**base, "kind": "quality", "window_set_id": WINDOW_SET,
         "metrics": {"ppl": ppl, "nll_se": 0.004, "delta_ppl_pct": 200 * kld, "kld_mean": kld,
                     "top1_agreement": max(0.5, 1 - 3 * kld), "synthetic": True}},
        {**base, "kind": "speed", "metrics": {"prompt_tok_per_s": {"median": 4000 / bpw * rng.uniform(0.9, 1.1)},
                                              "decode_tok_per_s": {"median": 400 / bpw}, "synthetic": True}},
    ]


ENGINES = {"gguf": "llama.cpp", "awq": "vllm", "exl2": "exl2-reference"}


def _blob_file(tmp: Path, model: str, i: int, bpw: float) -> Path:
    """A file of synthetic bytes whose size follows bpw (the chart needs sizes), unique per variant."""
    path = tmp / f"{model.replace('/', '_')}-{i}.bin"
    seed = hashlib.sha256(f"{model}/{i}".encode()).digest()
    path.write_bytes(seed * int(bpw * 8))
    return path


def fill_api(reg: Registry, model: str, n: int, tmp: Path, rng: random.Random) -> None:
    for i in range(n):
        name, fmt, spec, bpw = variant_plan(i)
        view = reg.register_version(RegisterRequest(
            model=model, architecture="LlamaForCausalLM", source=SOURCE, variant=name, format=fmt, spec=spec,
            build_key=f"synthetic-{model}-{i}", lineage={"tool": TOOL, "info": {"bpw": bpw}, "synthetic": True},
            files={f"{name}.bin": _blob_file(tmp, model, i, bpw)}), by="bench")
        for record in synthetic_results(bpw, ENGINES[fmt], rng):
            reg.add_result(view.ref, record)
        if i % 10 == 0:
            reg.set_alias(view.ref, "production", by="bench")


def fill_bulk(reg: Registry, models: list[str], n: int, tmp: Path, rng: random.Random) -> None:
    """Insert ``n`` variants per model with SQLAlchemy Core: the rows ``register_version`` writes."""
    from sqlalchemy import insert, select

    plans = [variant_plan(i) for i in range(n)]
    blobs = {(m, i): reg.blobs.put_file(_blob_file(tmp, m, i, plans[i][3])) for m in models for i in range(n)}
    with reg.engine.begin() as conn:
        conn.execute(insert(sql.Model.__table__), [{"name": m, "architecture": "LlamaForCausalLM"} for m in models])
        model_ids = dict(conn.execute(select(sql.Model.name, sql.Model.id).where(sql.Model.name.in_(models))).all())
        conn.execute(insert(sql.Source.__table__), [{
            "model_id": model_ids[m], "kind": "hub", "identity": SOURCE.identity, "repo_id": SOURCE.repo_id,
            "revision": SOURCE.revision, "commit": SOURCE.commit, "path": SOURCE.path} for m in models])
        source_ids = dict(conn.execute(select(sql.Source.model_id, sql.Source.id)).all())
        conn.execute(insert(sql.Blob.__table__), [{"sha256": b.sha256, "size": b.size}
                                                   for b in {b.sha256: b for b in blobs.values()}.values()])
        conn.execute(insert(sql.Variant.__table__), [
            {"model_id": model_ids[m], "name": p[0], "format": p[1], "spec": p[2]} for m in models for p in plans])
        variant_ids = {(mid, name): vid for vid, mid, name in conn.execute(
            select(sql.Variant.id, sql.Variant.model_id, sql.Variant.name))}
        conn.execute(insert(sql.Version.__table__), [{
            "variant_id": variant_ids[(model_ids[m], p[0])], "number": 1, "source_id": source_ids[model_ids[m]],
            "build_key": f"synthetic-{m}-{i}", "state": "candidate",
            "lineage": {"tool": TOOL, "info": {"bpw": p[3]}, "synthetic": True, "registered_by": "bench-bulk"}}
            for m in models for i, p in enumerate(plans)])
        version_ids = dict(conn.execute(select(sql.Version.variant_id, sql.Version.id)).all())
        rows: dict[str, list[dict[str, Any]]] = {"files": [], "results": [], "aliases": [], "audit": [], "inputs": []}
        for m in models:
            for i, (name, fmt, _, bpw) in enumerate(plans):
                vid = variant_ids[(model_ids[m], name)]
                ver = version_ids[vid]
                blob = blobs[(m, i)]
                rows["files"].append({"version_id": ver, "name": f"{name}.bin", "sha256": blob.sha256,
                                      "size": blob.size})
                rows["results"] += [{**r, "version_id": ver, "window_set_id": r.get("window_set_id")}
                                    for r in synthetic_results(bpw, ENGINES[fmt], rng)]
                names = ["latest"] + (["production"] if i % 10 == 0 else [])
                rows["aliases"] += [{"variant_id": vid, "name": a, "version_id": ver, "updated_by": "bench-bulk"}
                                    for a in names]
                rows["audit"] += [{"actor": "bench-bulk", "action": "register", "variant_id": vid,
                                   "version_id": ver, "new": "1"}]
                rows["inputs"] += [{"version_id": ver, "kind": "source", "ref": SOURCE.identity, "name": None,
                                    "sha256": None, "meta": {}},
                                   {"version_id": ver, "kind": "tool", "ref": "bench-synthetic@version=1",
                                    "name": "bench-synthetic", "sha256": None, "meta": TOOL}]
        for table, key in ((sql.VersionFile, "files"), (sql.Result, "results"), (sql.Alias, "aliases"),
                           (sql.AuditEvent, "audit"), (sql.VersionInput, "inputs")):
            conn.execute(insert(table.__table__), rows[key])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(registry: Path, port: int, cache: bool) -> subprocess.Popen[bytes]:
    """``quantyard serve`` in its own process (the one under test)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "QUANTYARD_WEB_CACHE_ENTRIES": "256" if cache else "0"}
    env.pop("QUANTYARD_WEB_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--registry", str(registry),
                             "--port", str(port), "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start within 120 s")


def measure(port: int, path: str, n: int, warmup: int = 5, headers: dict[str, str] | None = None
            ) -> tuple[list[float], int, int]:
    """Latencies (ms) of ``n`` sequential GETs over one keep-alive connection; (latencies, status, bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    out: list[float] = []
    status = size = 0
    for k in range(warmup + n):
        t0 = time.perf_counter()
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        body = resp.read()
        elapsed = (time.perf_counter() - t0) * 1000
        status, size = resp.status, len(body)
        if status >= 400:
            raise SystemExit(f"GET {path} answered {status}: {body[:300]!r}")
        if k >= warmup:
            out.append(elapsed)
    conn.close()
    return out, status, size


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def fill(args: argparse.Namespace, root: Path, tmp: Path, models: list[str]) -> None:
    rng = random.Random(7)
    t0 = time.perf_counter()
    reg = open_registry(str(root))
    files = tmp / "files"
    files.mkdir()
    fill_api(reg, models[0], args.variants, files, rng)
    t_api = time.perf_counter() - t0
    if args.fill == "api":
        for m in models[1:]:
            fill_api(reg, m, args.variants, files, rng)
    elif len(models) > 1:
        fill_bulk(reg, models[1:], args.variants, files, rng)
    shutil.rmtree(files)
    print(f"filled in {time.perf_counter() - t0:.1f} s (first model via the Registry API in {t_api:.1f} s, "
          f"the rest via {args.fill})")


def targets(reg: Registry, model: str) -> list[tuple[str, str, dict[str, str] | None]]:
    first = reg.variant_summaries(model)[0]
    ref, fname = first.ref, f"{first.variant}.bin"
    n = len(reg.variant_summaries(model))
    return [
        (f"model page (HTML, {n} variants)", f"/models/{model}", None),
        ("API model table (JSON)", f"/api/v1/models/{model}/-/table", None),
        ("API model detail (JSON)", f"/api/v1/models/{model}", None),
        ("models index (HTML)", "/", None),
        ("API models (JSON)", "/api/v1/models", None),
        ("version page (HTML)", f"/versions/{ref}", None),
        ("API version (JSON)", f"/api/v1/versions/{ref}", None),
        ("download, whole file (verified)", f"/api/v1/versions/{ref}/-/files/{fname}", None),
        ("download, Range 0-99", f"/api/v1/versions/{ref}/-/files/{fname}", {"Range": "bytes=0-99"}),
    ]


def run(root: Path, todo: list[tuple[str, str, dict[str, str] | None]], n: int, port: int, cache: bool) -> float:
    """Measure every target against a fresh server; returns the model page's p95."""
    server = start_server(root, port or free_port(), cache)
    port = int(server.args[server.args.index("--port") + 1])  # type: ignore[index, union-attr]
    try:
        print(f"\n{'cache on' if cache else 'cache OFF (every response built afresh)'}")
        print(f"{'endpoint':36} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'bytes':>9}   (n={n}, sequential, "
              "keep-alive, loopback)")
        p95s = []
        for label, path, headers in todo:
            lat, _, size = measure(port, path, n, headers=headers)
            p95s.append(pct(lat, 95))
            print(f"{label:36} {statistics.median(lat):8.1f} {p95s[-1]:8.1f} {max(lat):8.1f} {size:9,}")
        return p95s[0]
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, default=50)
    ap.add_argument("--variants", type=int, default=200, help="variants per model")
    ap.add_argument("--requests", type=int, default=200, help="measured requests per endpoint")
    ap.add_argument("--registry", type=Path, help="registry folder (default: a temp folder, removed); an existing "
                                                  "bench registry there is reused as it is")
    ap.add_argument("--fill", choices=("bulk", "api"), default="bulk")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--cache", choices=("both", "on", "off"), default="both",
                    help="measure with the server's response cache on, off, or both (default)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="quantyard-web-bench-"))
    root = args.registry or tmp / "registry"
    models = [f"bench/model-{k:03d}" for k in range(args.models)]
    try:
        if not (root / "registry.db").exists():
            fill(args, root, tmp, models)
        reg = open_registry(str(root), create=False)
        listed = reg.list_models()
        print(f"registry: {root}  {len(listed)} models, {sum(m.variants for m in listed)} SYNTHETIC variants; "
              f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
        todo = targets(reg, models[0])
        verdicts = []
        for cache in {"both": (False, True), "on": (True,), "off": (False,)}[args.cache]:
            p95 = run(root, todo, args.requests, args.port, cache)
            verdicts.append(f"cache {'on' if cache else 'off'}: p95 {p95:.1f} ms")
        print(f"\nmodel page target p95 < 100 ms — {'; '.join(verdicts)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
