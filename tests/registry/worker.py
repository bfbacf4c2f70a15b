"""A registering process for the concurrency and crash tests (run as ``python -m tests.registry.worker``).

``register``: register COUNT versions of demo/Q8_0; even-numbered files have the same bytes in every
process (so identical blobs race), odd ones are unique.
``crash``: start one registration and stop at a crash point, signalling through a marker file, so
the test can SIGKILL it there: ``commit`` (blob stored, rows written, transaction not committed) or
``blob`` (temp file complete and synced, not yet renamed into place).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from registry import open_registry
from registry.blobs import LocalBlobStore
from registry.store import Registry
from tests.registry.helpers import request


def _hang(marker: Path) -> None:
    marker.write_text("ready")
    time.sleep(600)


def _register(args: argparse.Namespace) -> None:
    reg = open_registry(args.location)
    if args.barrier:  # start together, so the writers really overlap
        (args.barrier / f"ready-{args.prefix}").touch()
        while not (args.barrier / "go").exists():
            time.sleep(0.01)
    started = time.time()
    for i in range(args.count):
        data = f"shared-{i}".encode() * 100 if i % 2 == 0 else f"{args.prefix}-{i}".encode() * 100
        reg.register_version(request(args.workdir, key=f"{args.prefix}-{i}", data=data))
    if args.barrier:  # when this writer was registering (wall clock: comparable between processes)
        (args.barrier / f"span-{args.prefix}").write_text(f"{started} {time.time()}")


def _crash(args: argparse.Namespace) -> None:
    reg = open_registry(args.location)
    if args.mode == "commit":
        original = Registry._move_alias

        def move_then_hang(*a: Any, **kw: Any) -> Any:
            out = original(*a, **kw)
            _hang(args.marker)
            return out

        Registry._move_alias = staticmethod(move_then_hang)  # type: ignore[method-assign]
    else:
        def finalize_hang(self: LocalBlobStore, *a: Any, **kw: Any) -> Any:
            _hang(args.marker)

        LocalBlobStore._finalize = finalize_hang  # type: ignore[method-assign]
    reg.register_version(request(args.workdir, key="crash", data=b"crashing-writer" * 1000))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["register", "crash"])
    p.add_argument("--location", required=True)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--prefix", default="p")
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--mode", choices=["commit", "blob"], default="commit")
    p.add_argument("--marker", type=Path)
    p.add_argument("--barrier", type=Path)
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    (_register if args.action == "register" else _crash)(args)


if __name__ == "__main__":
    main()
