"""Full disks: a conversion whose registry and work folders sit on a small real tmpfs ends with a clear
DiskFullError naming the path and the space needed, registers nothing half-way, and leaves no temp files.
Mounting a tmpfs needs root (CI runs as root); elsewhere these tests skip and say so."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.errors import DiskFullError
from registry.blobs import LocalBlobStore


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; run the suite as root (CI does) to exercise full disks")
    size_mb = 40
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _incomplete(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".incomplete")]


def test_blob_write_hitting_enospc_leaves_nothing(small_fs: Path) -> None:
    """A real ENOSPC in the middle of a streamed write (no size known up front)."""
    store = LocalBlobStore(small_fs / "blobs")
    with pytest.raises(DiskFullError) as info:
        store._put_stream(io.BytesIO(os.urandom(1 << 20) * 64))  # 64 MiB into a 40 MiB filesystem
    assert str(small_fs / "blobs") in str(info.value)
    assert not _incomplete(small_fs) and not list(store.list_blobs())


def test_convert_on_a_full_disk(small_fs: Path, demo_model: Path, tmp_path: Path) -> None:
    env = dict(os.environ, QUANTYARD_WORK_DIR=str(small_fs / "work"), QUANTYARD_DISK_HEADROOM_MB="8",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    registry = small_fs / "registry"
    cmd = [sys.executable, "-m", "pipeline.cli", "convert", str(demo_model), "--gguf", "Q8_0,Q6_K,Q5_K_M,Q4_K_M",
           "--name", "demo", "--registry", str(registry), "--no-eval"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "DiskFullError" in text and "MB" in text and str(small_fs) in text, text[-3000:]
    # the pre-flight's estimate (flows/preflight.py): refused before anything was written, saying what would not fit
    assert "would not fit" in text and "refused before any work" in text and "ESTIMATE" in text, text[-3000:]
    assert not (small_fs / "work" / "gguf-base").exists()
    assert not _incomplete(small_fs), _incomplete(small_fs)
    staging = small_fs / "work" / "staging"
    assert not staging.exists() or not any(staging.iterdir())
    verify = subprocess.run([sys.executable, "-m", "pipeline.cli", "registry", "verify", "--deep", "--registry",
                             str(registry)], env=env, capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_reference_whose_distribution_cannot_fit_stops_before_it_runs(small_fs: Path, demo_model: Path,
                                                                       tmp_path: Path, cache_dir: Path) -> None:
    """The exact-KLD reference stores 2 bytes per vocabulary entry per scored position (at 70 B, written after
    hours of forward passes): where that cannot fit, it is refused before the engine starts."""
    import numpy as np

    from evaluators.reference import full_store_bytes, run_reference
    from evaluators.windows import WindowSet
    from pipeline.config import Settings
    from pipeline.plan import EvalSpec

    n, w = 20, 512
    windows = tmp_path / "windows.npz"
    WindowSet(ids=np.ones((n, w), dtype=np.int32), score_start=np.ones(n, dtype=np.int32), window=w, stride=w,
              add_bos=False, text_sha256="0" * 64).save(windows)
    need = full_store_bytes(demo_model, windows)
    assert need == 2 * 4096 * n * (w - 1)  # the demo's vocabulary; 84 MB, over the 40 MB filesystem
    out = small_fs / "reference"
    with pytest.raises(DiskFullError) as info:
        run_reference(demo_model, windows, out, EvalSpec(reference_engine="transformers"),
                      Settings(cache_dir=cache_dir, threads=2))
    assert info.value.needed == need and str(out) in str(info.value)
    assert info.value.message.startswith(f"the reference's whole distribution for exact KLD ({n * (w - 1):,} scored "
                                         f"positions"), info.value.message
    assert "--max-windows" in (info.value.hint or "") and "--kld topk_lower_bound" in (info.value.hint or "")
    assert not any(out.iterdir())  # no engine ran: nothing written
