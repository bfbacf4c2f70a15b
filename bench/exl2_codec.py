"""Speed of Quantyard's EXL2 reference codec on CPU: dequantizing layers (MB/s of EXL2 tensors read
and of fp16 weights produced) and encoding them, for a few layer shapes and bit layouts.

    python bench/exl2_codec.py [--threads N] [--repeats R]

Times are CPU seconds of this process (``time.process_time``), median of the repeats: on a shared
machine wall time measures the neighbours; with ``--threads 1`` (the default) CPU time is what an
idle core would take.

There is no CPU EXL2 tool to compare against (ExLlamaV2 needs CUDA); for scale the script also
prints a plain fp16 → fp32 copy of the same weight (the cheapest possible "dequantization").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.exl2_codec import EXL2Linear, Group, dequantize, encode, padded

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (out, in) of a 7B-class attention / MLP layer
LAYOUTS = {"4b g128": [(4, 1.0)], "6/5b mix": [(6, 0.5), (5, 0.5)], "3/2b mix": [(3, 0.25), (2, 0.75)]}


def _layer(out: int, inp: int, parts: list[tuple[int, float]], group: int = 128) -> EXL2Linear:
    groups, left = [], inp
    for i, (bits, share) in enumerate(parts):
        n = left if i == len(parts) - 1 else min(left, round(inp * share / group) * group)
        while n > 0:
            groups.append(Group(bits, min(group, n)))
            n -= min(group, n)
            left -= groups[-1].rows
    cols = padded(out)
    q = torch.cat([torch.randint(0, 1 << g.bits, (g.rows, cols)) for g in groups]).to(torch.int16)
    return EXL2Linear(q=q, scale_codes=torch.randint(0, 16, (len(groups), cols)).to(torch.int16),
                      scale_max=(torch.rand(len(groups)) * 0.05 + 0.01).half(), groups=tuple(groups),
                      invperm=torch.randperm(inp).to(torch.int32), out_features=out)


def _time(fn: object, repeats: int) -> float:
    fn()  # type: ignore[operator]  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()  # type: ignore[operator]
        samples.append(time.process_time() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU seconds, median of {args.repeats}")
    print(f"{'layer':>12} {'layout':>9} {'EXL2 MB':>8} {'dequant s':>9} {'in MB/s':>8} {'out MB/s':>9} "
          f"{'encode s':>8} {'fp16→fp32 MB/s':>14}")
    for out, inp in SHAPES:
        for name, parts in LAYOUTS.items():
            layer = _layer(out, inp, parts)
            tensors = encode(layer)
            size = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
            t_dq = _time(lambda: dequantize(tensors), args.repeats)  # noqa: B023
            t_enc = _time(lambda: encode(layer), args.repeats)  # noqa: B023
            w16 = torch.randn(out, inp).half()
            t_copy = _time(lambda: w16.float(), args.repeats)  # noqa: B023
            out_mb = out * inp * 2 / 1e6
            print(f"{out:>5}x{inp:<6} {name:>9} {size:8.1f} {t_dq:9.3f} {size / t_dq:8.1f} {out_mb / t_dq:9.1f} "
                  f"{t_enc:8.3f} {out_mb / t_copy:14.1f}")


if __name__ == "__main__":
    main()
