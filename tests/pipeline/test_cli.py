"""CLI behaviour: bad input gives a typed error, exit code 2, a message saying what to do, and an
unchanged registry. Plus docs-as-tests: every command is documented in the command reference (docs/cli.md)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from tests.conftest import registry_snapshot
from tests.factories import (
    arch_checkpoint,
    bytelevel_bpe_checkpoint,
    copy_checkpoint,
    edit_config,
    random_checkpoint,
    truncate,
)

CLI_PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _missing(tmp: Path, demo: Path) -> Path:
    return tmp / "does-not-exist"


def _no_config(tmp: Path, demo: Path) -> Path:
    ckpt = copy_checkpoint(demo, tmp / "m")
    (ckpt / "config.json").unlink()
    return ckpt


def _truncated(tmp: Path, demo: Path) -> Path:
    ckpt = copy_checkpoint(demo, tmp / "m")
    truncate(ckpt / "model.safetensors", 5000)
    return ckpt


def _unknown_type(tmp: Path, demo: Path) -> Path:
    ckpt = copy_checkpoint(demo, tmp / "m")
    edit_config(ckpt, model_type="not-a-model")
    return ckpt


def _quantized(tmp: Path, demo: Path) -> Path:
    ckpt = copy_checkpoint(demo, tmp / "m")
    edit_config(ckpt, quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"})
    return ckpt


def _bpe(tmp: Path, demo: Path) -> Path:
    return bytelevel_bpe_checkpoint(tmp / "bpe", demo)


CASES: dict[str, tuple[Callable[[Path, Path], Path], str, str]] = {
    "missing-path": (_missing, "SourceNotFoundError", "does not exist"),
    "no-config": (_no_config, "InvalidCheckpointError", "config.json"),
    "truncated-safetensors": (_truncated, "InvalidCheckpointError", "truncated"),
    "unknown-model-type": (_unknown_type, "UnsupportedArchitectureError", "not-a-model"),
    "bytelevel-bpe-tokenizer": (_bpe, "TokenizerUnsupportedError", "pre-tokenizer"),
    "already-quantized": (_quantized, "InvalidCheckpointError", "already quantized"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_source_exit_2_registry_unchanged(case: str, tmp_path: Path, demo_model: Path, demo_registry: Path,
                                              prefect_harness: None) -> None:
    make, error_type, needle = CASES[case]
    source = make(tmp_path, demo_model)
    before = registry_snapshot(demo_registry)
    result = CliRunner().invoke(app, ["convert", str(source), "--gguf", "Q8_0", "--name", "demo",
                                      "--registry", str(demo_registry), "--no-speed"])
    assert result.exit_code == 2, result.output
    assert error_type in result.output and needle in result.output
    assert "→" in result.output  # every message says what to do
    assert registry_snapshot(demo_registry) == before


def test_unknown_gguf_type(demo_model: Path, demo_registry: Path) -> None:
    before = registry_snapshot(demo_registry)
    result = CliRunner().invoke(app, ["convert", str(demo_model), "--gguf", "Q8_0,Q7_X",
                                      "--registry", str(demo_registry)])
    assert result.exit_code == 2 and "UnknownQuantTypeError" in result.output and "Q4_K_M" in result.output
    assert registry_snapshot(demo_registry) == before


def test_registry_path_is_a_file(tmp_path: Path, demo_model: Path, prefect_harness: None) -> None:
    bogus = tmp_path / "registry"
    bogus.write_text("not a folder")
    result = CliRunner().invoke(app, ["convert", str(demo_model), "--gguf", "Q8_0", "--registry", str(bogus)])
    assert result.exit_code == 2 and "RegistryPathError" in result.output and "is a file" in result.output
    assert bogus.read_text() == "not a folder"


def test_a_failed_tool_is_named_by_its_own_error(tmp_path: Path, demo_model: Path, demo_registry: Path,
                                                prefect_harness: None) -> None:
    """Where llama.cpp's converter stops on a Python exception, the error line and the JSON error carry that
    exception, not only "exited with code 1" and a log path: here a Gemma-2 without the SentencePiece
    tokenizer.model its converter reads (the tokenizer.json beside it is complete)."""
    ckpt = random_checkpoint(tmp_path / "gemma2", demo_model, model_type="gemma2", head_dim=64, layers=1, tie=True)
    (ckpt / "tokenizer.model").unlink()
    before = registry_snapshot(demo_registry)
    result = CliRunner().invoke(app, ["convert", str(ckpt), "--gguf", "Q8_0", "--name", "g2", "--registry",
                                      str(demo_registry), "--no-speed", "--json"])
    assert result.exit_code == 3, result.output
    said = json.loads(result.stdout[result.stdout.index("{"):])
    assert said["type"] == "ConversionError" and "exited with code 1" in said["message"], said
    assert said["cause"] == f"FileNotFoundError: File not found: {ckpt / 'tokenizer.model'}", said
    assert f"error (ConversionError): {said['message']} ({said['cause']})" in " ".join(result.stderr.split())
    assert registry_snapshot(demo_registry) == before


def test_windows_longer_than_the_model_was_made_for_are_refused_before_any_work(
        tmp_path: Path, demo_model: Path, demo_registry: Path) -> None:
    """A GPT-2 evaluated on windows longer than its learned positions stopped the reference on an index error
    after the whole conversion; a RoPE model ran and measured extrapolation. The window is checked with the
    source, before any conversion."""
    ckpt = arch_checkpoint(tmp_path / "gpt2", demo_model, "gpt2", layers=1)
    before = registry_snapshot(demo_registry)
    result = CliRunner().invoke(app, ["convert", str(ckpt), "--gguf", "Q8_0", "--name", "g", "--registry",
                                      str(demo_registry), "--window", "2048", "--no-speed", "--json"])
    assert result.exit_code == 2, result.output
    said = json.loads(result.stdout[result.stdout.index("{"):])
    assert said["type"] == "InvalidSpecError", said
    assert said["message"] == ("evaluation windows of 2048 tokens are longer than gpt2 was made for: 1024 positions "
                               "(config.json n_positions)"), said
    assert said["hint"].startswith("pass --window 1024 or less"), said
    assert registry_snapshot(demo_registry) == before


@pytest.mark.parametrize(("content", "error", "said"), [
    (b"\xff\xfe not text", "ConfigError", "is not UTF-8 text: byte 0xff at offset 0 (invalid start byte)"),
    (b"", "InvalidSpecError", "the evaluation text (file:eval.txt) has 0 bytes, so fewer than one window of 512"),
    (b"short text only.\n", "InvalidSpecError", "has 17 bytes, so fewer than one window of 512 tokens"),
])
def test_an_evaluation_text_that_cannot_hold_a_window_is_refused_before_any_work(
        content: bytes, error: str, said: str, tmp_path: Path, demo_model: Path, demo_registry: Path) -> None:
    """Before, a binary file stopped the command with an internal UnicodeDecodeError traceback, and an empty or
    short one converted and registered the variant before the reference failed."""
    text = tmp_path / "eval.txt"
    text.write_bytes(content)
    before = registry_snapshot(demo_registry)
    result = CliRunner().invoke(app, ["convert", str(demo_model), "--gguf", "Q8_0", "--name", "t", "--registry",
                                      str(demo_registry), "--eval-text", str(text), "--no-speed", "--json"])
    assert result.exit_code == 2, result.output
    got = json.loads(result.stdout[result.stdout.index("{"):])
    assert got["type"] == error and said in got["message"], got
    assert registry_snapshot(demo_registry) == before


def test_a_text_short_in_tokens_fails_the_evaluation_saying_why(tmp_path: Path, demo_model: Path,
                                                                demo_registry: Path) -> None:
    """Long enough in bytes for the early check, too short in tokens: the window set says so, and each variant's
    evaluation error carries that reason, not only "upstream reference did not finish"."""
    text = tmp_path / "eval.txt"
    text.write_text((demo_model / "eval.txt").read_text(encoding="utf-8")[:1500], encoding="utf-8")
    result = CliRunner().invoke(app, ["convert", str(demo_model), "--gguf", "Q8_0", "--name", "demo", "--registry",
                                      str(demo_registry), "--eval-text", str(text), "--no-speed", "--json"])
    assert result.exit_code == 3, result.output
    (variant,) = json.loads(result.stdout[result.stdout.index("{"):])["variants"]
    assert variant["status"] == "reused" and variant["eval_status"] == "failed", variant
    assert variant["eval_error"].startswith("upstream reference did not finish (reference: InvalidSpecError: the "
                                            "evaluation text has "), variant
    assert "tokens, fewer than one window of 512" in variant["eval_error"], variant


def test_json_error_output(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["show", "demo/Q8_0", "--registry", str(tmp_path / "r"), "--json"])
    assert result.exit_code == 2
    assert '"error": "not_found"' in result.stdout


def test_console_script_exit_codes(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "quantyard"
    ok = subprocess.run([str(exe), "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "convert" in ok.stdout
    bad = subprocess.run([str(exe), "pull", "demo/Q8_0", str(tmp_path / "out"), "--registry", str(tmp_path / "no")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "RegistryPathError" in bad.stderr


LEAVE = """\
import atexit, sys, threading, time
from pathlib import Path
from pipeline.cli import leave
out = Path(sys.argv[1])
atexit.register(lambda: out.with_suffix(".atexit").write_text("ran"))
if sys.argv[2] == "thread":  # a non-daemon thread still running: a normal exit, which waits for it
    threading.Thread(target=lambda: (time.sleep(0.5), out.with_suffix(".thread").write_text("done"))).start()
sys.stdout.write("x" * 1_000_000)  # more than a pipe holds: flushed before the process ends
code = sys.argv[3]
leave(int(code) if code.isdigit() else code)
"""


@pytest.mark.parametrize(("code", "status"), [("0", 0), ("3", 3), ("a message", 1)])
@pytest.mark.parametrize("mode", ["plain", "thread"])
def test_leaving_keeps_the_exit_status_the_output_and_the_exit_handlers(tmp_path: Path, code: str, status: int,
                                                                        mode: str) -> None:
    """``leave`` skips the interpreter's teardown but not what a finished command needs: the status (a message
    goes to stderr with status 1, as sys.exit does), all of stdout through a pipe, every atexit handler, and a
    non-daemon thread still running is waited for."""
    out = tmp_path / "mark"
    res = subprocess.run([sys.executable, "-c", LEAVE, str(out), mode, code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert res.returncode == status, res.stderr
    assert len(res.stdout) == 1_000_000
    assert out.with_suffix(".atexit").read_text() == "ran"
    assert ("a message" in res.stderr) == (code == "a message")
    if mode == "thread":
        assert out.with_suffix(".thread").read_text() == "done"


LEAVE_AFTER_A_FAILED_FLOW = """\
import sys
from pathlib import Path
from pipeline.cli import leave  # first, as in the command: its imports (logging's exit handler) come before the server
from flows import embedded
server = embedded.start(Path(sys.argv[1]))
assert server is not None and server.decision() == "url"
from prefect import flow, get_run_logger
server.ready()

@flow
def fails() -> None:
    get_run_logger().error("the-marker of a failed run")
    raise RuntimeError("failed on purpose")

try:
    fails()
except RuntimeError:
    pass
leave(3)
"""


def test_leaving_sends_a_failed_runs_logs_before_the_embedded_server_stops(tmp_path: Path) -> None:
    """A failed flow's error logs reach Prefect's embedded server: Prefect's log worker drains (a threading
    exit hook) before Quantyard's atexit handler stops the server, as in a normal exit. ``leave`` once ran
    only the atexit handlers: the server went first (logging's own handler, which also flushes Prefect's, was
    registered before it and so runs after it), the logs were lost and the command's last words were Prefect's
    "Error logging to API"."""
    import os
    import sqlite3

    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_LOGGING_TO_API_BATCH_INTERVAL="60")  # longer than the run: only a drain sends them
    res = subprocess.run([sys.executable, "-c", LEAVE_AFTER_A_FAILED_FLOW, str(tmp_path / "logs")], env=env,
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=180)
    assert res.returncode == 3, res.stderr[-3000:]
    assert "Error logging to API" not in res.stderr, res.stderr[-3000:]
    with sqlite3.connect(home / "prefect.db") as db:
        (state,) = db.execute("SELECT state_name FROM flow_run WHERE name IS NOT NULL").fetchone()
        messages = [m for (m,) in db.execute("SELECT message FROM log")]
    assert state == "Failed"
    assert "the-marker of a failed run" in messages, messages


def test_pull_verifies(tmp_path: Path, demo_registry: Path) -> None:
    result = CliRunner().invoke(app, ["pull", "demo/Q8_0@1", str(tmp_path / "out"), "--registry", str(demo_registry)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "demo-Q8_0.gguf").is_file()


def test_every_command_is_documented() -> None:
    """The command reference (docs/cli.md) is generated from the app; tests/scripts/test_docs.py checks it is
    current. Here: every command and sub-command has its section."""
    import typer.main

    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    text = CLI_PAGE.read_text()
    missing = []
    for name, cmd in commands.items():
        names = [f"{name} {sub}" for sub in cmd.commands] if hasattr(cmd, "commands") else [name]
        missing += [n for n in names if f"## `quantyard {n}`" not in text]
    assert not missing, f"commands missing from docs/cli.md: {missing}"


def test_convert_flags_become_one_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every flag group of `convert` reaches the Plan that plan_from_options builds (nothing runs)."""
    import pipeline.cli.convert as convert

    seen: list[tuple[Any, Any, bool]] = []
    monkeypatch.setattr(convert, "run_plan", lambda plan, cfg, as_json: seen.append((plan, cfg, as_json)))
    result = CliRunner().invoke(app, ["convert", "owner/name", "--gguf", "Q8_0", "--exl2", "4.0", "--name", "n",
                                      "--revision", "main", "--registry", str(tmp_path / "r"), "--force",
                                      "--window", "256", "--score-from", "129", "--no-speed", "--threads", "2",
                                      "--imatrix", "--gguf-base", "bf16", "--json"])
    assert result.exit_code == 0, result.output
    ((plan, cfg, as_json),) = seen
    assert (plan.source.source, plan.source.revision, plan.model_name, plan.force) == ("owner/name", "main", "n", True)
    assert [v.format.value for v in plan.variants] == ["gguf", "exl2"] and plan.variants[0].imatrix
    assert (plan.eval.window, plan.eval.score_from, plan.eval.speed.enabled) == (256, 129, False)
    assert '"BF16"' in plan.model_dump_json()  # --gguf-base, normalised (the only BF16 in this plan)
    assert (cfg.registry, cfg.threads, as_json) == (str(tmp_path / "r"), 2, True)


@dataclass(frozen=True)
class _Flags:
    a: int = 1
    b: int = 2


def test_flag_groups_must_name_every_flag_once() -> None:
    from pipeline.cli.common import flag_groups

    def command(flags: _Flags) -> None: ...

    with pytest.raises(TypeError, match="flag order"):
        flag_groups(["a"])(command)
    with pytest.raises(TypeError, match="flag order"):
        flag_groups(["a", "b", "c"])(command)
    assert list(inspect.signature(flag_groups(["b", "a"])(command)).parameters) == ["b", "a"]


def test_a_flag_a_model_rejects_is_bad_input_not_an_internal_error(demo_model: Path) -> None:
    result = CliRunner().invoke(app, ["convert", str(demo_model), "--gguf", "Q8_0", "--top-k", "0"])
    assert result.exit_code == 2, result.output
    assert "top_k" in result.output and "internal error" not in result.output


def test_recommend_takes_the_trained_context_by_default(demo_registry: Path) -> None:
    """A first `quantyard recommend MODEL --max-memory 8G` stopped on "Missing option '--context'": the context
    now defaults to the one the model was trained for, read from its registered files and said."""
    result = CliRunner().invoke(app, ["recommend", "demo", "--max-memory", "8G", "--registry", str(demo_registry)])
    assert "Missing option" not in result.output, result.output
    assert result.exit_code in (0, 1), result.output  # 1: nothing served yet, so nothing fits (each says why)
    assert "note: context 2,048 tokens: the model's trained context (demo/" in result.stderr, result.stderr
    assert "context 2,048, 1 users" in result.stdout
