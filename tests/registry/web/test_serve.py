"""`quantyard serve`: the real command in its own process, and its typed errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from typer.testing import CliRunner

from pipeline.cli import app
from tests.registry.servers import free_port

REPO = Path(__file__).resolve().parents[3]


def test_serve_refuses_a_missing_registry(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", "--registry", str(tmp_path / "nowhere"), "--port", "1"])
    assert result.exit_code == 2
    assert "no registry at" in result.output
    assert not (tmp_path / "nowhere").exists()  # serving never creates a registry


def test_serve_runs_the_app_in_its_own_process(small_registry: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "QUANTYARD_WEB_TOKEN": "s3cr3t-xyz"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--registry", str(small_registry),
                             "--port", str(port), "--log-level", "warning"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(base + "/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "quantyard serve did not answer within 120 s"
                time.sleep(0.2)
        assert [m["name"] for m in httpx.get(base + "/api/v1/models").json()] == ["acme/tiny", "other"]
        r = httpx.put(base + "/api/v1/versions/acme/tiny/F16@1/-/aliases/canary",
                      headers={"Authorization": "Bearer s3cr3t-xyz"})
        assert r.status_code == 200  # the token came from QUANTYARD_WEB_TOKEN through Settings
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0].decode()
    assert "writes enabled" in out and "s3cr3t-xyz" not in out  # the token is never printed
