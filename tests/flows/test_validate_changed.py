"""The CI example's logic (scripts/validate-changed.sh) on a real git repository of quants."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from junitparser import JUnitXml

from registry import open_registry
from tests.flows.test_validate import damage_tensor_data

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "validate-changed.sh"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.mark.slow
def test_validate_changed_quants(tmp_path: Path, demo_registry: Path, demo_model: Path) -> None:
    repo = tmp_path / "quants"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "user.email", "ci@example.com")
    _git(repo, "config", "user.name", "ci")
    (repo / "README.md").write_text("quants\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "base")
    reg = open_registry(str(demo_registry))
    (good,) = reg.pull("demo/Q4_K_M", repo / "demo")
    (repo / "demo" / "demo-Q4_K_M.gguf.source").write_text(f"{demo_model}\n")
    q8_blob = reg.blobs.path_of(reg.get_version("demo/Q8_0").files[0].sha256)
    damage_tensor_data(q8_blob, repo / "demo" / "demo-Q8_0.gguf")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "add quants")

    reports = tmp_path / "reports"
    env = dict(os.environ)
    cli = tmp_path / "quantyard"
    cli.write_text(f"#!/bin/sh\nexec {sys.executable} -m pipeline.cli \"$@\"\n")
    cli.chmod(0o755)
    env["QUANTYARD"] = str(cli)
    env["PYTHONPATH"] = str(SCRIPT.parents[1])
    proc = subprocess.run([str(SCRIPT), "main~1", "--source", str(demo_model), "--junit-dir", str(reports),
                           "--registry", str(demo_registry)], cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    files = sorted(p.name for p in reports.iterdir())
    assert files == ["demo_demo-Q4_K_M.gguf.xml", "demo_demo-Q8_0.gguf.xml"]
    verdicts = {}
    for f in reports.iterdir():
        suite = next(iter(JUnitXml.fromfile(str(f))))
        verdicts[f.name] = sorted(c.name for c in suite if c.result and c.result[0]._tag == "failure")
    assert verdicts == {"demo_demo-Q4_K_M.gguf.xml": [], "demo_demo-Q8_0.gguf.xml": ["quality"]}
    assert good.is_file()
