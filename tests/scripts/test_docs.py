"""The documentation cannot drift (scripts/docs.py): its figures come from bench/results/ and the code, its command
reference from the app; a changed number in a result file, a new option or a hand-typed figure fails the check.
``make docs`` runs the same check, then ``mkdocs build --strict``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import docs  # noqa: E402  (scripts/docs.py)

README_LIMIT = 12_288


def test_the_documentation_is_true_to_its_sources() -> None:
    assert docs.problems(ROOT) == []


def _site(tmp: Path, figure: str) -> Path:
    (tmp / "docs").mkdir(parents=True)
    (tmp / "bench" / "results").mkdir(parents=True)
    (tmp / "bench" / "results" / "run.txt").write_text(
        "# command: python bench/x.py\n# commit: abc1234\n\n### whole job\n\n| way | s |\n|---|---:|\n"
        f"| ours | {figure} |\n")
    (tmp / "README.md").write_text("# x\n\nThe job:\n\n<!-- render:section:run.txt:whole job -->\n<!-- /render -->\n")
    (tmp / "docs" / "cli.md").write_text(docs.cli_page())
    return tmp


def test_a_number_changed_in_a_result_file_fails_the_check(tmp_path: Path) -> None:
    root = _site(tmp_path, "12.5")
    docs.render(root)
    assert "| ours | 12.5 |" in (root / "README.md").read_text()
    assert docs.problems(root) == []
    result = root / "bench" / "results" / "run.txt"
    result.write_text(result.read_text().replace("12.5", "13.1"))
    found = docs.problems(root)
    assert found == ["README.md: a rendered block differs from its source (run python scripts/docs.py render)"]


def test_a_hand_typed_measurement_fails_the_check(tmp_path: Path) -> None:
    root = _site(tmp_path, "1")
    docs.render(root)
    page = root / "docs" / "index.md"
    page.write_text("The whole job took 12.5 s, `1.5 s` in code is fine,\n\n```\n3 GiB in a fence too\n```\n"
                    "and a definition: 8G is 8 GiB <!-- not-measured -->\n")
    found = docs.problems(root)
    assert len(found) == 1 and "docs/index.md:1: figure '12.5 s' has no source" in found[0], found


def test_a_section_cut_before_a_line_closes_its_code_block(tmp_path: Path) -> None:
    root = tmp_path
    (root / "bench" / "results").mkdir(parents=True)
    (root / "bench" / "results" / "demo.txt").write_text(
        "# command: make demo\n\n### demo results\n\n```\n| Q8_0 | 1.77e-05 |\ntime and memory per stage\n"
        "| build | 0.3 |\n```\n\n### setup output\n")
    text = docs.fragment("section:demo.txt:demo results|time and memory per stage", root)
    assert "| Q8_0 | 1.77e-05 |" in text and "build" not in text and "setup" not in text
    assert text.endswith("```") and text.count("```") == 2, text
    assert "up to “time and memory per stage”" in text
    with pytest.raises(KeyError, match="no line starting with 'nowhere'"):
        docs.fragment("section:demo.txt:demo results|nowhere", root)


def test_a_missing_result_file_or_fragment_is_named(tmp_path: Path) -> None:
    root = _site(tmp_path, "1")
    (root / "docs" / "a.md").write_text("<!-- render:file:gone.txt -->\n<!-- /render -->\n"
                                        "<!-- render:no-such-fragment -->\n<!-- /render -->\n")
    found = docs.problems(root)
    assert any("bench/results/gone.txt does not exist" in f for f in found), found


def test_the_policy_table_is_the_policys_limits() -> None:
    from pipeline.policy import DEFAULT_CLASSES, DEFAULT_TYPES

    table = docs.policy_limits(ROOT)
    for name, lim in {**DEFAULT_CLASSES, **DEFAULT_TYPES}.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        assert f"| {lim.max_kld:g} | {lim.max_delta_ppl_pct:g} |" in row, (name, row)
        if lim.min_top1 is not None:
            assert row.endswith(f"| {100 * lim.min_top1:g} |"), (name, row)
    validation = (ROOT / "docs" / "validation.md").read_text()
    assert table in validation  # the page shows this very table (the check keeps it rendered)


def test_the_command_reference_is_the_app() -> None:
    import typer.main

    from pipeline.cli import app

    page = (ROOT / "docs" / "cli.md").read_text()
    assert page == docs.cli_page()
    for name, cmd in typer.main.get_command(app).commands.items():  # type: ignore[attr-defined]
        subs = [f"{name} {s}" for s in cmd.commands] if hasattr(cmd, "commands") else [name]
        for sub in subs:
            assert f"## `quantyard {sub}`" in page, sub


def test_the_readme_is_short_and_says_how_to_convert_ones_own_model_early() -> None:
    raw = (ROOT / "README.md").read_bytes()
    assert len(raw) <= README_LIMIT, len(raw)
    head = raw[:3072].decode("utf-8", errors="ignore")
    assert ".venv/bin/quantyard convert " in head, "the first quantyard convert on one's own folder is later than 3 KB"


@pytest.mark.parametrize("page", ["hardware.md"])
def test_the_gpu_status_has_one_source(page: str) -> None:
    from pipeline.status import markdown_table

    assert markdown_table() in (ROOT / "docs" / page).read_text()
    stale = ("prepared, not yet run", "no GPU has been lent", "not yet run on a GPU")
    for path in [*ROOT.glob("pipeline/**/*.py"), *ROOT.glob("converters/**/*.py"), *ROOT.glob("evaluators/**/*.py"),
                 *ROOT.glob("docs/**/*.md"), ROOT / "README.md"]:
        text = path.read_text(encoding="utf-8")
        for said in stale:
            assert said not in text, f"{path.relative_to(ROOT)} states a GPU status itself ({said!r}): " \
                                     "point at pipeline/status.py"
