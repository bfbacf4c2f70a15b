"""``quantyard work``: what a run leaves in the work folder, when each entry was last used, and pruning it.

The entries are real: the GGUF converter's base, tokenizer agreement and calibration text for the demo
checkpoint, in a private work folder. The lease is held by a real second process; the CLI runs as a subprocess.
That a running convert flow holds the lease, and that a SIGKILLed one leaves it free, is checked by
tests/reliability/test_crash.py on a real killed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from converters.base import BuildContext, Calibration
from converters.checkpoint import load_checkpoint
from converters.gguf.converter import PARITY_DIR, GGUFConverter
from converters.source import resolve_source
from pipeline import workdir
from pipeline.config import Settings
from pipeline.errors import ConfigError, WorkInUseError
from pipeline.specs import GGUFSpec
from pipeline.texts import text_sha256

REPO = Path(__file__).resolve().parents[2]
OLD_S = 40 * workdir.DAY_S


def _ctx(demo_model: Path, cfg: Settings) -> BuildContext:
    text = (demo_model / "eval.txt").read_text(encoding="utf-8")
    return BuildContext(checkpoint=load_checkpoint(demo_model), source=resolve_source(str(demo_model),
                        cache_dir=cfg.cache_dir), model_name="demo", settings=cfg,
                        calibration=Calibration(text=text[:4000], origin="test:calibration"),
                        texts={"checkpoint:eval.txt": text})


def _age(entries: list[workdir.WorkEntry], seconds: float) -> None:
    then = time.time() - seconds
    for e in entries:
        os.utime(e.path, (then, then))


def _by_kind(root: Path) -> dict[str, list[workdir.WorkEntry]]:
    out: dict[str, list[workdir.WorkEntry]] = {}
    for e in workdir.entries(root):
        out.setdefault(e.kind, []).append(e)
    return out


def test_runs_mark_what_they_reuse_and_prune_removes_only_what_went_unused(demo_model: Path, settings: Settings,
                                                                            tmp_path: Path) -> None:
    work = settings.work_root
    ctx = _ctx(demo_model, settings)
    conv = GGUFConverter(settings)
    prepared = conv.prepare(ctx, [])
    first = conv.build(ctx, prepared, GGUFSpec(type="Q8_0"), tmp_path / "Q8_0").parameters["tokenizer_parity"]
    calib, _ = conv.calibration_file(ctx)
    assert first["checked"] == f"identical tokenizer metadata, checked on {Path(prepared.paths['base']).name}"

    kinds = _by_kind(work)
    assert sorted(kinds) == ["calibration", "gguf-base", "gguf-parity"]
    (base,) = kinds["gguf-base"]
    base_file = Path(prepared.paths["base"])
    assert base.path == base_file.parent and base.size_bytes >= base_file.stat().st_size > 0
    (parity,) = kinds["gguf-parity"]
    assert parity.path.parent == work / PARITY_DIR
    assert [e.key for e in kinds["calibration"]] == [text_sha256(ctx.calibration.text)] == [calib.stem]  # type: ignore[union-attr]
    assert all(e.age_days() < 0.01 for e in workdir.entries(work))

    # forty days pass; a dry run lists all three and removes nothing
    _age(workdir.entries(work), OLD_S)
    assert {e.path for e in workdir.prune(work, 30, dry_run=True)} == {base.path, parity.path, calib}
    assert base_file.is_file() and calib.is_file() and parity.path.is_file()

    # a new run (another converter, as another process would be) reuses the base and the agreement
    again = GGUFConverter(settings)
    reused = again.prepare(ctx, [])
    assert "convert_base" not in reused.events and reused.paths["base"] == str(base_file)
    second = again.build(ctx, reused, GGUFSpec(type="Q4_K_M"), tmp_path / "Q4_K_M").parameters["tokenizer_parity"]
    assert second["checked"].startswith("identical tokenizer metadata")
    ages = {e.kind: e.age_days() for e in workdir.entries(work)}
    assert ages["gguf-base"] < 0.01 and ages["gguf-parity"] < 0.01 and ages["calibration"] > 39.9

    # only the calibration text went unused for more than 30 days
    gone = workdir.prune(work, 30)
    assert [e.path for e in gone] == [calib] and not calib.exists()
    assert base_file.is_file() and parity.path.is_file()
    with pytest.raises(ConfigError, match="--older-than must be 0 or more"):
        workdir.prune(work, -1)

    # 0 removes the rest (a later run converts and checks again, as on a fresh machine)
    assert {e.kind for e in workdir.prune(work, 0)} == {"gguf-base", "gguf-parity"}
    assert workdir.entries(work) == [] and not base_file.exists() and not parity.path.exists()


def _cli(args: list[str], work: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QUANTYARD_WORK_DIR": str(work), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "work", *args, "--json"], env=env, text=True,
                          capture_output=True, timeout=120)


def test_prune_is_refused_while_a_job_holds_the_lease_and_free_once_it_is_killed(demo_model: Path,
                                                                                 settings: Settings) -> None:
    work = settings.work_root
    calib, _ = GGUFConverter(settings).calibration_file(_ctx(demo_model, settings))
    listed = json.loads(_cli(["list"], work).stdout)
    assert [(e["kind"], e["path"]) for e in listed["entries"]] == [("calibration", str(calib))]
    assert listed["root"] == str(work) and listed["entries"][0]["size_bytes"] == calib.stat().st_size

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\nfrom pipeline import workdir\n"
         "with workdir.lease(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(300)\n", str(work)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        refused = _cli(["prune", "--older-than", "0"], work)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert json.loads(refused.stdout)["error"] == "work_in_use" and "is in use" in refused.stderr
        assert calib.is_file()
        with pytest.raises(WorkInUseError):
            workdir.prune(work, 0)
        listing = json.loads(_cli(["prune", "--older-than", "0", "--dry-run"], work).stdout)  # a dry run still lists
        assert [e["path"] for e in listing["entries"]] == [str(calib)] and calib.is_file()
        # two jobs may hold the lease together
        with workdir.lease(work):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    done = _cli(["prune", "--older-than", "0"], work)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [e["path"] for e in json.loads(done.stdout)["entries"]] == [str(calib)] and not calib.exists()
