"""bench/pipeline_vs_llamacpp.py end to end on a checkpoint it was not built for: any local folder (``--model
PATH``), here a copy of the demo checkpoint without its eval.txt, so that both ways score Quantyard's built-in
held-out text from one file. Both ways really run (llama.cpp's tools by hand, then ``quantyard convert`` in a
child), on 2 windows; the test checks the tables, not the speed (a ratio on a busy test machine means nothing).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from pipeline.config import Settings
from tests.bench import demo_copy_without_eval_text, load_script

QUANTS = ("Q8_0", "Q4_K_M", "Q2_K")


@pytest.fixture(scope="module")
def pv() -> ModuleType:
    return load_script("pipeline_vs_llamacpp")


def _variant_rows(text: str) -> dict[str, list[float]]:
    """The variant table: name -> [PPL llama.cpp, PPL quantyard, KLD llama.cpp, KLD quantyard, top-1 ×2]."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0] in QUANTS and len(cells) == 7:
            rows[cells[0]] = [float(c) for c in cells[1:]]
    return rows


def test_a_local_folder_runs_both_ways_on_one_text(pv: ModuleType, tmp_path: Path, demo_model: Path,
                                                   cache_dir: Path) -> None:
    folder = demo_copy_without_eval_text(demo_model, tmp_path / "some-checkpoint")
    cfg = Settings(cache_dir=cache_dir, work_dir=tmp_path / "work", threads=2)
    out = pv.run_model(str(folder), cfg, windows=2, threads=2, reference="llama.cpp")

    assert f"### {folder} ({folder}), text: Quantyard's built-in held-out text" in out
    assert "Quantyard: 2 windows, 510 scored positions" in out  # llama-perplexity's --chunks 2 scores the same
    for step in ("resolve (hash the source)", "base conversion", "3 quantizations", "reference", "3 evaluations",
                 "**whole command**"):
        assert f"| {step} |" in out
    resolve_row = next(line for line in out.splitlines() if line.startswith("| resolve (hash the source) |"))
    for part in ("content hash", "config, shapes, tokenizer and format checks", "NaN/Inf scan"):
        assert f"{part} " in resolve_row and " s" in resolve_row, resolve_row  # each part of it, timed
    rows = _variant_rows(out)
    assert sorted(rows) == sorted(QUANTS)
    for name, (ppl_h, ppl_q, kld_h, kld_q, top_h, top_q) in rows.items():
        # the same file, tokens and positions on the same llama.cpp build: the same perplexity; the KLDs differ
        # only by llama.cpp's 16-bit stored base (bench/results: within 1 %) and top-1 by a position or two
        assert ppl_q == pytest.approx(ppl_h, rel=1e-4), name
        assert kld_q == pytest.approx(kld_h, rel=0.05, abs=2e-6), name
        assert abs(top_q - top_h) <= 0.5, name
    assert rows["Q8_0"][3] < rows["Q4_K_M"][3] < rows["Q2_K"][3]  # the types stay in their order
    assert not list((tmp_path / "work").glob("bench-vs-llamacpp-*"))  # its temporary folders are gone


def test_a_folder_that_is_not_a_checkpoint_is_refused_with_what_was_expected(pv: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--model .*: expected demo, real or a local Hugging Face checkpoint "
                                         r"folder .* found a folder without a config.json"):
        pv.checkpoint_folder(str(tmp_path))
    with pytest.raises(SystemExit, match="found no such folder"):
        pv.checkpoint_folder(str(tmp_path / "missing"))


def test_a_missing_text_is_refused(pv: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--text .*: expected an existing text file"):
        pv.eval_text_file(tmp_path, tmp_path / "nope.txt", tmp_path)
