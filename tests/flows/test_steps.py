"""flows/steps.py: sweep_stale, the clean-up of what killed runs left in the work root, while other threads and
runs make and remove scratch folders under the same root."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

from flows.steps import sweep_stale
from pipeline.config import Settings


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_sweep_removes_dead_runs_partials_and_survives_folders_vanishing_meanwhile(tmp_path: Path) -> None:
    work = tmp_path / "work"
    dead, alive = _dead_pid(), os.getpid()
    base = work / "gguf-base" / "k1"
    base.mkdir(parents=True)
    dead_file = base / f"m-F16.gguf.{dead}-ab12.incomplete"
    dead_file.write_bytes(b"x")
    dead_folder = work / "awq" / f"W4A16.{dead}-cd34.incomplete"
    (dead_folder / "sub").mkdir(parents=True)
    (dead_folder / "sub" / "model.safetensors").write_bytes(b"y")
    ours = base / f"m-Q8_0.gguf.{alive}-ef56.incomplete"
    ours.write_bytes(b"z")
    settings = Settings(work_dir=work)  # type: ignore[call-arg]
    assert settings.work_root == work

    stop = threading.Event()

    def churn() -> None:  # another writer's scratch folders, made and removed as fast as it can
        n = 0
        while not stop.is_set():
            folder = work / "tmp" / f"{alive}-churn{n % 4}" / "a" / "b"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "f").write_bytes(b"")
            shutil.rmtree(folder.parent.parent, ignore_errors=True)
            n += 1

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        swept: set[Path] = set()
        for _ in range(200):
            swept.update(sweep_stale(settings))
    finally:
        stop.set()
        writer.join()
    assert swept == {dead_file, dead_folder}
    assert not dead_file.exists() and not dead_folder.exists() and ours.exists()
