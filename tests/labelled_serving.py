"""A registry holding serving results of every kind a page, a card, ``validate`` and ``recommend`` must handle,
built through the Registry API (real SQLite registry, no mocks).

EVERY NUMBER HERE IS SYNTHETIC: written by this module, not measured. The results say so where a reader of a
page or a screenshot sees them: the server version is ``SYNTHETIC``, the load tool ``synthetic-fixture (not
guidellm)``, the hardware ``note`` and the profile note say "synthetic test data". What the tests check is how
serving results are stored, shown, gated and ranked, not these figures. Model ``acme/serving``:

==================  ======  ============================  =========  ===========================================
variant             format  quality (exact unless noted)  peak (GB)  serving result
==================  ======  ============================  =========  ===========================================
Q8_0                gguf    KLD 0.001                     9.1        llama.cpp, ctx 8192 × 64 users, 1/8/32/64
Q6_K                gguf    KLD 0.006                     7.0        llama.cpp, levels 1 and 8 only
Q5_K_M              gguf    KLD 0.012                     6.0        llama.cpp, full sweep
Q4_K_M              gguf    KLD 0.03                      5.2        llama.cpp, full sweep (fastest of the fits)
Q4_K_S              gguf    KLD 0.045                     5.5        llama.cpp, slower than Q4_K_M: dominated
Q3_K_M              gguf    KLD 0.1                       4.6        llama.cpp, 3 failed requests at 32 users
Q2_K                gguf    KLD 0.4                       3.9        llama.cpp, p99 TTFT 1.4 s at 32 users
IQ4_XS              gguf    KLD top-K lower bound 0.04    4.8        llama.cpp, full sweep
AWQ-W4-G128-asym    awq     KLD 0.02                      4.1        vLLM, dense-matmul kernel, CPU-scaled, ctx 4096
EXL2-4.0bpw         exl2    KLD 0.025                     —          none
==================  ======  ============================  =========  ===========================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.serving import LevelStats, LoadProfile, MemoryInfo, Percentiles, RequestRecord, ServerInfo, ServingMetrics
from pipeline.specs import SourceKind, SourceRef
from registry import open_registry
from registry.store import RegisterRequest

MODEL = "acme/serving"
SRC = SourceRef(kind=SourceKind.HUB, path="/hub", repo_id="acme/serving", revision="main", commit="cd" * 20)
WS, REF = "3c" * 32, "d4" * 32
SYNTHETIC = "SYNTHETIC test data written by tests/labelled_serving.py, not a measurement"
USERS = (1, 8, 32, 64)
GB = 10**9
DENSE = {"wna16_kernel": "dequantized (dense matmul; SYNTHETIC)", "wna16_kernel_id": "dequantized"}


def pct(median: float, p99: float) -> Percentiles:
    return Percentiles(mean=median * 1.05, median=median, p90=(median + p99) / 2, p99=p99)


def level(users: int, ttft_ms: float, itl_ms: float, tok_s: float, failed: int = 0,
          log: bool = False) -> LevelStats:
    """One closed-loop level: TTFT and ITL at ``users`` as given (p99 = 2 × median), ``tok_s`` output tok/s."""
    records = [RequestRecord(t_sent=0.0, t_first=ttft_ms / 1000, t_last=1.0, token_times=[0.1 * i for i in range(50)],
                             prompt_tokens=512, output_tokens=256)] if log else []
    return LevelStats(mode="concurrency", concurrency=users, requests=200, completed=200 - failed, failed=failed,
                      duration_s=60.0, ttft_ms=pct(ttft_ms / 2, ttft_ms), tpot_ms=pct(itl_ms / 2, itl_ms),
                      itl_ms=pct(itl_ms / 2, itl_ms),
                      e2el_ms=pct(ttft_ms + 256 * itl_ms / 2, 2 * ttft_ms + 256 * itl_ms),
                      request_throughput=tok_s / 256, output_throughput=tok_s, total_token_throughput=tok_s * 3,
                      requests_log=records)


def sweep(ttft1: float, itl1: float, tok1: float, users: tuple[int, ...] = USERS, failed_at: int | None = None,
          slow_at: dict[int, float] | None = None) -> list[LevelStats]:
    """Levels whose p99 TTFT grows with the users and whose throughput saturates (synthetic shapes)."""
    out = []
    for u in users:
        ttft = (slow_at or {}).get(u, ttft1 * (1 + u / 16))
        out.append(level(u, ttft, itl1 * (1 + u / 32), tok1 * u / (1 + u / 24), failed=3 if u == failed_at else 0,
                         log=u == 1))
    return out


def serving(engine: str, levels: list[LevelStats], peak_gb: float, *, context: int = 8192, users: int = 64,
            cpu_scaled: bool = False, flags: dict[str, Any] | None = None, device: bool = False) -> dict[str, Any]:
    """A serving result (``EvalResult`` mapping) with a SYNTHETIC ``ServingMetrics``."""
    server = {"llama.cpp": "llama-server", "vllm": "vllm serve"}[engine]
    peak = int(peak_gb * GB)
    kv = int(0.25 * peak)
    metrics = ServingMetrics(
        server=ServerInfo(engine=engine, server=server, version="SYNTHETIC", command=["synthetic-fixture"],
                          parallel_slots=users, context_per_request=context, context_total=context * users,
                          continuous_batching=True, flags=flags or {}),
        profile=LoadProfile(name="cpu-scaled" if cpu_scaled else "seed", tool="synthetic-fixture (not guidellm)",
                            prompt_tokens=128 if cpu_scaled else 512, output_tokens=64 if cpu_scaled else 256,
                            concurrencies=[lv.concurrency or 0 for lv in levels], requests_per_level=200,
                            warmup_requests=8, timeout_s=600,
                            note=("CPU: scaled from the seed shape 512/256; " if cpu_scaled else "") + SYNTHETIC),
        levels=levels,
        memory=MemoryInfo(weights_bytes=peak // 2, rss_peak_bytes=None if device else peak,
                          device_peak_bytes=peak if device else None, kv_cache_bytes=kv,
                          kv_cache_tokens=context * users, kv_cache_source="SYNTHETIC", context=context,
                          concurrency=max(lv.concurrency or 0 for lv in levels)))
    return {"kind": "serving", "engine": engine, "engine_version": f"{engine} SYNTHETIC", "status": "ok",
            "metrics": metrics.model_dump(mode="json"), "hardware": {"cpu": "SYNTHETIC", "threads": 16,
                                                                     "note": SYNTHETIC}}


def exact(kld: float) -> dict[str, Any]:
    return {"kind": "quality", "engine": "", "status": "ok", "window_set_id": WS,
            "metrics": {"ppl": 20.0 * (1 + kld), "delta_ppl_pct": 100 * kld, "kld_mean": kld,
                        "kld_method": "full-vocabulary", "top1_agreement": 1 - kld, "reference_key": REF}}


def lower_bound(kld: float) -> dict[str, Any]:
    return {"kind": "quality", "engine": "", "status": "ok", "window_set_id": WS,
            "metrics": {"ppl": 20.5, "delta_ppl_pct": 2.5, "kld_topk_lower_bound_mean": kld,
                        "kld_method": "top-32 + tail (lower bound)", "top1_agreement": 0.9, "reference_key": REF}}


LLAMA = "llama.cpp"
# variant -> (format, spec, engine of the quality result, results)
SERVED: dict[str, tuple[str, dict[str, Any], str, list[dict[str, Any]]]] = {
    "Q8_0": ("gguf", {"type": "Q8_0"}, LLAMA, [exact(0.001), serving(LLAMA, sweep(60, 20, 60), 9.1)]),
    "Q6_K": ("gguf", {"type": "Q6_K"}, LLAMA, [exact(0.006), serving(LLAMA, sweep(55, 18, 66, users=(1, 8)), 7.0)]),
    "Q5_K_M": ("gguf", {"type": "Q5_K_M"}, LLAMA, [exact(0.012), serving(LLAMA, sweep(50, 16, 70), 6.0)]),
    "Q4_K_M": ("gguf", {"type": "Q4_K_M"}, LLAMA, [exact(0.03), serving(LLAMA, sweep(40, 14, 85), 5.2)]),
    "Q4_K_S": ("gguf", {"type": "Q4_K_S"}, LLAMA, [exact(0.045), serving(LLAMA, sweep(45, 15, 75), 5.5)]),
    "Q3_K_M": ("gguf", {"type": "Q3_K_M"}, LLAMA, [exact(0.1), serving(LLAMA, sweep(38, 13, 90, failed_at=32), 4.6)]),
    "Q2_K": ("gguf", {"type": "Q2_K"}, LLAMA, [exact(0.4), serving(LLAMA, sweep(35, 12, 95, slow_at={32: 1400}),
                                                                    3.9)]),
    "IQ4_XS": ("gguf", {"type": "IQ4_XS"}, LLAMA, [lower_bound(0.04), serving(LLAMA, sweep(42, 14, 80), 4.8)]),
    "AWQ-W4-G128-asym": ("awq", {"bits": 4, "group_size": 128, "symmetric": False}, "vllm", [
        exact(0.02), serving("vllm", sweep(300, 90, 12), 4.1, context=4096, cpu_scaled=True, flags=DENSE)]),
    "EXL2-4.0bpw": ("exl2", {"bpw": 4.0, "head_bits": 6}, "exllamav2", [exact(0.025)]),
}


def register(reg: Any, tmp: Path, name: str, fmt: str, spec: dict[str, Any], model: str = MODEL) -> str:
    path = tmp / model.replace("/", "_") / name / "weights.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(name.encode()[:1] * 4000)
    view = reg.register_version(RegisterRequest(
        model=model, architecture="LlamaForCausalLM", source=SRC, variant=name, format=fmt, spec=spec,
        build_key=f"synthetic-{model}-{name}", lineage={"tool": {"name": "synthetic-fixture"}, "info": {"bpw": 4.5}},
        files={"weights.bin": path}))
    return str(view.ref)


def build_serving_registry(root: Path, tmp: Path) -> Path:
    """Build ``acme/serving`` into a new registry at ``root``; returns ``root``."""
    reg = open_registry(str(root))
    for name, (fmt, spec, engine, results) in SERVED.items():
        ref = register(reg, tmp, name, fmt, spec)
        for record in results:
            reg.add_result(ref, {**record, "engine": record["engine"] or engine})
    return root
