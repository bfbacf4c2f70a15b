"""The reference stage on a GPU, measured at growing model sizes: Quantyard's own transformers reference
(evaluators/reference.py ``run_reference``: the runner subprocess, bfloat16 on ``cuda:0``, the whole vocabulary
stored for exact KLD) over the same windows, for SYNTHETIC Llama checkpoints from ~0.3 B to ~8 B parameters.

Each checkpoint is built on the GPU (random weights from a fixed seed, bf16 safetensors, Llama-3's 128,256-token
vocabulary, :data:`SHAPES`) with the demo tokenizer (its token ids are all < 4,096, so every id is valid), saved to
local disk, measured, and deleted. Its costs are real; its perplexity means nothing and is not used.

Per size it records: parameters; build seconds (not part of the stage); the stage's wall seconds from the
caller's side (interpreter and torch start, weights from disk to the GPU, the scoring loop, the stored
distribution written); the runner's own scoring-loop seconds (``eval_s``: forward passes, logits copied to the
host, the host's log-softmax and encoding); when the stage ran (``stage_epoch_s``, to set beside what else ran on
the machine); peak GPU memory (``nvidia-smi`` sampled every 100 ms, less what was
in use before); the stored file's bytes. bench/scaling.py ``--gpu FILE`` fits these (load ≈ a + b·P, loop ≈
c + d·P·T) and puts the fitted GPU reference into its 8 B / 70 B tables in place of its assumption.

Needs CUDA: it is run by scripts/gpu-check.sh on a lent GPU machine; elsewhere it exits 2 saying so. It writes
its JSON after every size, so a run cut short keeps what it measured; ``--stop-after S`` starts no new size
after S seconds.

Usage: python bench/gpu_reference.py --tokenizer DIR --out FILE.json [--windows 16] [--sizes 0.3B,1.5B,3.6B,8B]
[--stop-after 300] [--work DIR] [--note TEXT] [--device cpu --sizes tiny: a dry run of the script, no GPU]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB = 128256
#: name -> (hidden, intermediate, layers, attention heads, key-value heads): Llama-3-like shapes.
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (64, 128, 2, 4, 2),  # a dry run of the script itself (--device cpu)
    "0.3B": (768, 2048, 12, 12, 4),
    "1.5B": (2048, 8192, 16, 32, 8),  # Llama-3.2-1B's shape, its embeddings untied
    "3.6B": (3072, 8192, 28, 24, 8),  # Llama-3.2-3B's shape, its embeddings untied
    "8B": (4096, 14336, 32, 32, 8),  # Llama-3-8B's shape
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


class GpuMemory:
    """Peak ``memory.used`` of GPU 0 (MiB) from ``nvidia-smi -lms 100`` while the block runs."""

    def __init__(self) -> None:
        self.peak = 0.0
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    @staticmethod
    def now() -> float:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, check=True).stdout
        return float(out.split()[0])

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self.peak = max(self.peak, float(line.strip()))
            except ValueError:
                continue

    def __enter__(self) -> GpuMemory:
        self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                       "-i", "0", "-lms", "100"], stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None and self._thread is not None
        self._proc.terminate()
        self._proc.wait()
        self._thread.join(timeout=5)


def build_checkpoint(dest: Path, shape: tuple[int, int, int, int, int], tokenizer: Path, device: str) -> int:
    """A random bf16 Llama of ``shape`` built on ``device`` and saved to ``dest``; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    hidden, inter, layers, heads, kv = shape
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(dest, safe_serialization=True)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, dest / name)
    return int(params)


def measure(name: str, work: Path, tokenizer: Path, text: str, windows: int, threads: int,
            device: str) -> dict[str, Any]:
    from evaluators.reference import run_reference
    from evaluators.windows import build_window_set
    from pipeline.config import Settings
    from pipeline.plan import EvalSpec

    ckpt = work / name
    shutil.rmtree(ckpt, ignore_errors=True)
    t0 = time.perf_counter()
    params = build_checkpoint(ckpt, SHAPES[name], tokenizer, device)
    build_s = time.perf_counter() - t0
    ws = build_window_set(ckpt, text, window=512, stride=512, max_windows=windows, score_from=257)
    ws.save(work / f"{name}-windows.npz")
    n_windows = int(ws.ids.shape[0])
    spec = EvalSpec(window=512, score_from=257, reference_dtype="bfloat16", reference_device=device)
    settings = Settings(work_dir=work / "qy-work", cache_dir=work / "qy-cache", threads=threads)
    started = time.time()
    gpu = device != "cpu"
    before = GpuMemory.now() if gpu else 0.0
    with GpuMemory() if gpu else contextlib.nullcontext() as mem:
        t1 = time.perf_counter()
        _, summary = run_reference(ckpt, work / f"{name}-windows.npz", work / f"{name}-out", spec, settings)
        wall = time.perf_counter() - t1
    peak = mem.peak if isinstance(mem, GpuMemory) else None
    row = {"size": name, "shape": SHAPES[name], "vocab": VOCAB, "params": params,
           "checkpoint_bytes": sum(f.stat().st_size for f in ckpt.glob("*.safetensors")),
           "windows": n_windows, "tokens": n_windows * 512, "scored": summary["n_tokens"],
           "build_s": round(build_s, 2), "stage_wall_s": round(wall, 2), "eval_s": round(summary["eval_s"], 2),
           "load_and_start_s": round(wall - summary["eval_s"], 2),
           "device": device, "gpu_peak_mib": peak, "gpu_before_mib": before if gpu else None,
           "gpu_stage_peak_mib": None if peak is None else peak - before,
           "stored_bytes": summary["file_bytes"], "devices": summary.get("devices"),
           "engine_version": summary["engine_version"], "stage_epoch_s": [round(started, 1), round(time.time(), 1)]}
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(work / f"{name}-out", ignore_errors=True)
    return row


def machine(device: str) -> dict[str, Any]:
    import torch

    smi = "none (a CPU dry run)" if device == "cpu" else subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True).stdout.strip()
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), platform.processor())
    return {"gpu": smi, "gpus": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with the demo tokenizer and its texts")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--sizes", default=",".join(s for s in SHAPES if s != "tiny"))
    ap.add_argument("--stop-after", type=float, default=300.0, help="start no new size after this many seconds")
    ap.add_argument("--work", type=Path, default=Path("gpu-work"))
    ap.add_argument("--note", default="", help="what else ran on the machine meanwhile (recorded)")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run of the script)")
    args = ap.parse_args()
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        print(f"bench/gpu_reference.py needs a CUDA GPU; torch {torch.__version__} sees none: run it through "
              "scripts/gpu-check.sh on a GPU machine", file=sys.stderr)
        raise SystemExit(2)
    sizes = [s for s in args.sizes.split(",") if s]
    if unknown := [s for s in sizes if s not in SHAPES]:
        raise SystemExit(f"--sizes: unknown {unknown}; expected some of {', '.join(SHAPES)}")
    text = "\n".join((args.tokenizer / f).read_text(encoding="utf-8") for f in ("eval.txt", "calibration.txt")
                     if (args.tokenizer / f).exists())
    args.work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "machine": machine(args.device), "note": args.note,
                              "rows": [], "skipped": []}
    start = time.perf_counter()
    for name in sizes:
        if time.perf_counter() - start > args.stop_after:
            report["skipped"].append({"size": name, "why": f"--stop-after {args.stop_after:.0f} s reached"})
        else:
            try:
                report["rows"].append(measure(name, args.work, args.tokenizer, text, args.windows,
                                              os.cpu_count() or 1, args.device))
            except Exception as exc:  # recorded, and the next size still runs
                report["skipped"].append({"size": name, "why": f"{type(exc).__name__}: {exc}"[:2000]})
        args.out.write_text(json.dumps(report, indent=1))
        print(json.dumps(report["rows"][-1] if report["rows"] else report["skipped"][-1]), flush=True)
    raise SystemExit(0 if report["rows"] else 1)


if __name__ == "__main__":
    main()
