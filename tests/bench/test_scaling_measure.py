"""bench/scaling.py measuring a size of your own: a local checkpoint folder by its path (here a copy of the demo
checkpoint without its eval.txt, so Quantyard's built-in held-out text is scored). One real ``quantyard convert``
in a child, sampled; the test checks what was recorded, not how fast it was."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from pipeline.config import Settings
from tests.bench import demo_copy_without_eval_text, load_script


@pytest.fixture(scope="module")
def sc() -> ModuleType:
    return load_script("scaling")


def test_a_local_folder_is_measured_stage_by_stage(sc: ModuleType, tmp_path: Path, demo_model: Path,
                                                   cache_dir: Path) -> None:
    folder = demo_copy_without_eval_text(demo_model, tmp_path / "mine")
    assert sc.parse_windows(None, ["demo", str(folder)]) == {"demo": 16, str(folder): sc.FOLDER_WINDOWS}
    cfg = Settings(cache_dir=cache_dir, work_dir=tmp_path / "work", threads=2)
    ckpt = sc.size_checkpoint(str(folder), cfg)
    run = sc.measure(str(folder), ckpt, cfg, windows=2, threads=2)

    assert run.params == sc.param_count(folder) > 1_000_000
    assert run.vocab == 4096 and not run.synthetic and run.windows == 2
    for stage in ("hash", "prepare:gguf", "reference", "other", *(f"{k}:{t}" for k in ("build", "evaluate")
                                                                 for t in ("Q8_0", "Q4_K_M", "Q2_K"))):
        assert run.stages[stage].seconds > 0, stage
    parts = [run.stages[p].seconds for p in sc.SOURCE_PARTS.values()]  # resolving the source, part by part
    assert all(x > 0 for x in parts) and sum(parts) <= run.stages["hash"].seconds
    assert run.stages["other"].seconds + sum(s.seconds for k, s in run.stages.items() if k != "other") - sum(
        parts) == pytest.approx(run.total_s)  # the parts are inside "hash": counted once
    assert run.stages["reference"].tokens == run.stages["evaluate:Q2_K"].tokens == 2 * 512
    assert run.stages["build:Q2_K"].tokens == 0
    assert run.peak_bytes > 100e6  # the child alone holds an interpreter with torch and transformers
    table = sc.measured_table(run)
    assert f"### {folder}: " in table and "vocabulary 4,096, a local checkpoint; 2 windows" in table
    assert not list((tmp_path / "work").glob("bench-scaling-*"))


def test_sizes_name_a_bad_folder_with_their_option(sc: ModuleType, tmp_path: Path) -> None:
    vs = sc.vs
    with pytest.raises(SystemExit, match=r"--sizes .*: expected demo, real, big or a local Hugging Face "
                                         r"checkpoint folder .* found no such folder"):
        vs.checkpoint_folder(str(tmp_path / "nope"), option="--sizes", builtin="demo, real, big")
