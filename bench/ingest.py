"""Registry ingest throughput against ``sha256sum`` on the same file (target: ratio ≥ 0.9).

Ingest on the same filesystem links the file into the blob store (reflink where the filesystem
can, else a hardlink) and hashes it once, so it should run at hashing speed. The copy path (another
filesystem, forced here with ``link=False``) hashes while copying in one pass and is reported too.

    python bench/ingest.py [--size-mb 1024] [--repeats 3] [--dir /path/on/the/registry/filesystem]

Both tools read the same file from a warm page cache; each timing is the median of the repeats.
A ratio is sha256sum time / ingest time (1.0 = as fast as sha256sum).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from registry.blobs import LocalBlobStore


def _make_file(path: Path, size_mb: int) -> None:
    import os

    with path.open("wb") as fh:
        for _ in range(size_mb):
            fh.write(os.urandom(1 << 20))


def _sha256sum(path: Path) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(["sha256sum", str(path)], check=True, capture_output=True, text=True).stdout
    elapsed = time.perf_counter() - t0
    assert len(out.split()[0]) == 64
    return elapsed


def _ingest(path: Path, root: Path, link: bool) -> tuple[float, str]:
    store = LocalBlobStore(root, link=link)
    t0 = time.perf_counter()
    blob = store.put_file(path)
    elapsed = time.perf_counter() - t0
    store.delete(blob.sha256)  # the next repeat must store it again, not hit the dedup path
    return elapsed, blob.method


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="work folder (default: a temp folder)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="quantyard-bench-", dir=args.dir))
    try:
        src = work / "input.bin"
        _make_file(src, args.size_mb)
        _sha256sum(src)  # warm the page cache
        ref, link, copy, method = [], [], [], ""
        for _ in range(args.repeats):
            ref.append(_sha256sum(src))
            t, method = _ingest(src, work / "blobs-link", link=True)
            link.append(t)
            copy.append(_ingest(src, work / "blobs-copy", link=False)[0])
        mb = args.size_mb * (1 << 20) / 1e6
        r, lk, cp = statistics.median(ref), statistics.median(link), statistics.median(copy)
        print(f"file: {args.size_mb} MiB in {work}; medians of {args.repeats}")
        print(f"sha256sum            {r:7.3f} s  {mb / r:8.1f} MB/s")
        print(f"ingest ({method:8s})   {lk:7.3f} s  {mb / lk:8.1f} MB/s  ratio {r / lk:.3f}  (target >= 0.9)")
        print(f"ingest (hash+copy)   {cp:7.3f} s  {mb / cp:8.1f} MB/s  ratio {r / cp:.3f}  (other filesystem)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
