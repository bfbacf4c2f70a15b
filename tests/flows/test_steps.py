"""flows/steps.py: sweep_stale, the clean-up of what killed runs left in the work root, while other threads and
runs make and remove scratch folders under the same root; resolve, whose parts (hash, checks, NaN/Inf scan) each
announce themselves, the formats' checks before the scan that reads every weight."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from converters.checkpoint import load_checkpoint
from flows.steps import resolve, sweep_stale
from pipeline.config import Settings
from pipeline.errors import InvalidCheckpointError, InvalidSpecError
from pipeline.plan import Plan, SourceInput
from pipeline.progress import RESOLVE_PARTS, Event, listening
from pipeline.specs import GGUFSpec
from tests.factories import copy_checkpoint


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


def _with_value(ckpt: Path, value: float) -> Path:
    """``ckpt`` with one weight of its first float matrix set to ``value``."""
    path = next(ckpt.glob("*.safetensors"))
    tensors = safetensors.numpy.load_file(str(path))
    name = next(k for k, t in tensors.items() if t.ndim == 2 and np.issubdtype(t.dtype, np.floating))
    tensors[name] = tensors[name].copy()
    tensors[name][1, 2] = value
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    return ckpt


def _resolve_events(source: Path, settings: Settings, *variants: GGUFSpec) -> tuple[list[tuple[str, str]],
                                                                                Exception | None]:
    plan = Plan(source=SourceInput(source=str(source)), variants=variants or (GGUFSpec(type="Q8_0"),))
    events: list[Event] = []
    err: Exception | None = None
    with listening(events.append):
        try:
            resolve(plan, settings)
        except Exception as exc:  # the test reads the error
            err = exc
    parts = [e for e in events if e.phase != "note"]  # notes: what the pre-flight said (its reference, refusals)
    assert all(e.detail == str(source) for e in parts)
    assert all(e.stage == "note" for e in events if e.phase == "note")
    return [(e.stage, e.phase) for e in parts], err


def test_resolve_announces_its_parts_in_order(tmp_path: Path, demo_model: Path, cache_dir: Path) -> None:
    settings = Settings(cache_dir=cache_dir, work_dir=tmp_path / "work")  # type: ignore[call-arg]
    parts = [RESOLVE_PARTS[k] for k in ("hash", "check", "scan")]
    seen, err = _resolve_events(demo_model, settings)
    assert err is None
    assert seen == [(p, phase) for p in parts for phase in ("start", "done")]

    nan = _with_value(copy_checkpoint(demo_model, tmp_path / "nan"), float("nan"))
    seen, err = _resolve_events(nan, settings)
    assert isinstance(err, InvalidCheckpointError) and "NaN/Inf" in str(err)
    assert seen == [*[(p, phase) for p in parts[:2] for phase in ("start", "done")], (parts[2], "start"),
                    (parts[2], "failed")]


def test_a_format_refusing_the_request_stops_resolve_before_the_scan(tmp_path: Path, demo_model: Path,
                                                                    cache_dir: Path) -> None:
    """An IQ2_XXS without an importance matrix (the GGUF format's check refuses it) from a checkpoint with an
    infinite weight: the check stops resolve before the scan would read every weight (at 70 B, minutes)."""
    settings = Settings(cache_dir=cache_dir, work_dir=tmp_path / "work")  # type: ignore[call-arg]
    source = _with_value(copy_checkpoint(demo_model, tmp_path / "inf"), float("inf"))
    seen, err = _resolve_events(source, settings, GGUFSpec(type="IQ2_XXS"))
    assert isinstance(err, InvalidSpecError) and "importance matrix" in str(err), err
    assert seen == [(RESOLVE_PARTS["hash"], "start"), (RESOLVE_PARTS["hash"], "done"),
                    (RESOLVE_PARTS["check"], "start"), (RESOLVE_PARTS["check"], "failed")]
    with pytest.raises(InvalidCheckpointError, match="NaN/Inf"):  # the value the check stopped before reading
        load_checkpoint(source, check_shapes=False)


def test_a_missing_llama_cpp_is_said_before_the_source_is_hashed(tmp_path: Path, demo_model: Path,
                                                                 cache_dir: Path) -> None:
    """Without llama.cpp's converter a GGUF request failed in the format checks, after the source was hashed
    (a 70 B source: minutes of reading for an error about the machine)."""
    from pipeline.errors import ToolchainMissingError

    settings = Settings(cache_dir=cache_dir, work_dir=tmp_path / "work",  # type: ignore[call-arg]
                        llama_cpp_tools=tmp_path / "nowhere")
    seen, err = _resolve_events(demo_model, settings, GGUFSpec(type="Q8_0"))
    assert isinstance(err, ToolchainMissingError) and "nowhere" in str(err), err
    assert seen == []


def _hf_cache_snapshot(demo: Path, repo: Path) -> Path:
    """``demo`` laid out as the Hugging Face cache keeps a download: files in ``blobs`` named by their hash, and
    the snapshot folder of relative links to them (what ``hf download`` prints and users pass as a folder)."""
    import hashlib

    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in demo.iterdir():
        if f.is_file():
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, blob)
            (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    return snapshot


def test_a_hugging_face_cache_snapshot_folder_is_a_source_and_links_out_of_it_are_not(
        tmp_path: Path, demo_model: Path, cache_dir: Path) -> None:
    """Its files are links into the repository's blobs: refused before as escaping the folder. Links into the
    blobs are taken; one to anywhere else still is refused."""
    from pipeline.errors import UnsafeSourceError

    settings = Settings(cache_dir=cache_dir, work_dir=tmp_path / "work")  # type: ignore[call-arg]
    snapshot = _hf_cache_snapshot(demo_model, tmp_path / "hub" / "models--demo--tiny")
    plan = Plan(source=SourceInput(source=str(snapshot)), variants=(GGUFSpec(type="Q8_0"),))
    resolved = resolve(plan, settings)
    assert resolved.checkpoint.path == snapshot and resolved.checkpoint.n_params == load_checkpoint(demo_model).n_params
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(demo_model / "tokenizer.json")  # outside the blobs
    with pytest.raises(UnsafeSourceError, match="outside the checkpoint folder"):
        resolve(plan, settings)
