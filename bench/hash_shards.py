"""The source's content hash on a sharded checkpoint: what bench/scaling.py's "hash" line does not measure.

scaling.py fits the content hash on its three checkpoints, and each of them is one safetensors file, so the
fit is one file on one thread (hashlib's sha256 on one core). Sources of 8 B and more come sharded (the Hub's
default shard is 5 GB: an 8 B bf16 checkpoint has 4 shards, a 70 B one about 30), and
converters/checkpoint.py's ``content_hash`` reads up to ``min(CPUs, HASH_WORKERS)`` files at once. This script
measures both on one checkpoint's bytes: the same tensors saved as one file and as ``--shards`` files (split by
huggingface_hub's ``split_torch_state_dict_into_shards``, written by safetensors, with the index file the Hub
writes), each hashed with one worker and with the default number, from the page cache (warm: the file was read
just before) and cold (every file's pages dropped first with ``posix_fadvise(DONTNEED)``, which needs no
privilege: the read comes from the disk, or from whatever cache the host keeps below this VM). No hash cache
is used: every run reads every byte.

Default checkpoint: scaling.py's synthetic ~0.77 B (``big``, built once). Prints seconds, GB/s, seconds per
billion parameters, and the sharded/one-file ratio per setting; ``--out`` also writes them to a file.

Usage: python bench/hash_shards.py [--size big|real|PATH] [--shards 4] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: a script's own folder, not when loaded by path

import scaling

from converters.checkpoint import HASH_WORKERS, content_hash
from pipeline.config import Settings
from pipeline.fs import atomic_path

#: Files of the source folder that are not weights and go into both copies unchanged.
SIDE_FILES = ("config.json", "generation_config.json", *scaling.BIG_COPIED)


def sharded_copy(src: Path, shards: int, cache: Path) -> Path:
    """``src``'s single safetensors file re-saved as about ``shards`` files plus model.safetensors.index.json,
    built once under ``cache``; the side files are copied."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import load_file, save_file

    weights = sorted(src.glob("*.safetensors"))
    if len(weights) != 1:
        raise SystemExit(f"{src} has {len(weights)} safetensors files; this script shards a one-file checkpoint")
    final = cache / f"{src.name}-{shards}shards"
    if (final / "model.safetensors.index.json").exists():
        return final
    state = load_file(weights[0])
    size = sum(t.numel() * t.element_size() for t in state.values())
    split = split_torch_state_dict_into_shards(state, max_shard_size=int(size / shards * 1.1))  # whole tensors
    with atomic_path(final) as staging:
        staging.mkdir(parents=True)
        for name, keys in split.filename_to_tensors.items():
            save_file({k: state[k].contiguous() for k in keys}, staging / name, metadata={"format": "pt"})
        index = {"metadata": {"total_size": size}, "weight_map": split.tensor_to_filename}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        for name in SIDE_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, staging / name)
    del state, torch
    return final


def drop_pages(root: Path) -> None:
    """Ask the kernel to drop every file's cached pages under ``root`` (clean pages go; no privilege needed)."""
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed_hash(root: Path, workers: int, cold: bool) -> tuple[float, str]:
    if cold:
        drop_pages(root)
    else:
        content_hash(root, workers=workers)  # the read that makes it warm
    t0 = time.perf_counter()
    digest = content_hash(root, workers=workers)
    return time.perf_counter() - t0, digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="big", help="big, real, or a one-file checkpoint folder")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = Settings()
    one = scaling.size_checkpoint(args.size, cfg)
    sharded = sharded_copy(one, args.shards, cfg.cache_dir / "synthetic" / "sharded")
    params = scaling.param_count(one)
    nbytes = sum(p.stat().st_size for p in one.glob("*.safetensors"))
    default_workers = max(1, min(os.cpu_count() or 1, HASH_WORKERS))
    n_shards = len(list(sharded.glob("*.safetensors")))
    lines = [scaling.header(sys.argv, os.getloadavg(), default_workers),
             f"# sha_ni: {'yes' if 'sha_ni' in Path('/proc/cpuinfo').read_text().split() else 'no'} (hashlib's "
             "sha256 uses it)",
             f"# checkpoint: {one} ({params / 1e9:.3f} B parameters, {nbytes / 1e9:.2f} GB of safetensors); "
             f"sharded copy: {n_shards} files",
             f"# median of {args.repeats}; default workers here = min(CPUs, HASH_WORKERS={HASH_WORKERS}) = "
             f"{default_workers}",
             "| layout | workers | pages | seconds (each) | median s | GB/s | s per B params |",
             "|---|---|---|---|---|---|---|"]
    results: dict[tuple[str, int, str], float] = {}
    for layout, root in (("one file", one), (f"{n_shards} shards", sharded)):
        for workers in sorted({1, default_workers}):
            for pages in ("warm", "cold"):
                runs = [timed_hash(root, workers, pages == "cold") for _ in range(args.repeats)]
                if len({d for _, d in runs}) != 1:
                    raise SystemExit(f"{root}: the content hash changed between runs")
                secs = [s for s, _ in runs]
                med = statistics.median(secs)
                results[(layout, workers, pages)] = med
                lines.append(f"| {layout} | {workers} | {pages} | {', '.join(f'{s:.2f}' for s in secs)} | "
                             f"{med:.2f} | {nbytes / med / 1e9:.2f} | {med / (params / 1e9):.2f} |")
                print(lines[-1], flush=True)
    lines.append("")
    base = results[("one file", 1, "warm")]
    for (layout, workers, pages), med in results.items():
        lines.append(f"- {layout}, {workers} worker(s), {pages}: {med / base:.2f}x the one-file one-worker warm hash")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
