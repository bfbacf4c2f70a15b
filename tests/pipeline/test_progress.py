"""Long stages say where they are (pipeline/progress.py): the tools' own progress lines become progress events of
the stage that runs them, shown on the console and written to Prefect's logs."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.progress import (
    Event,
    LineWatch,
    Throttle,
    convert_line,
    describe,
    listening,
    quantize_line,
    runner_line,
    stage,
)

#: Lines as the tools print them (llama-quantize of llama-cpp-python 0.3.36; convert_hf_to_gguf.py's tqdm bar;
#: a runner's own line, evaluators/protocol.py report_progress).
QUANTIZE = ("[  12/ 291]                  blk.1.attn_k.weight - [ 4096,  1024,     1,     1], type =   bf16, "
            "converting to q4_K .. size =     8.00 MiB ->     2.25 MiB")
CONVERT = "Writing:  34%|███▍      | 5.03G/14.8G [00:35<01:05, 150Mbyte/s]"


def test_each_tools_line_is_read() -> None:
    assert quantize_line(QUANTIZE) == (12.0, 291.0, "tensors", "")
    assert convert_line(CONVERT) == (5.03, 14.8, "GB written", "")
    assert runner_line("quantyard-progress windows 3/8 tokens=1536") == (3.0, 8.0, "windows", "tokens=1536")
    assert quantize_line("llama_model_quantize_impl: model size = 14.96 GB") is None
    assert convert_line("INFO:hf-to-gguf:blk.0.attn_q.weight, torch.bfloat16 --> BF16") is None


def test_progress_goes_to_the_innermost_open_stage_with_an_eta(tmp_path: Path) -> None:
    log = tmp_path / "tool.err"
    seen: list[Event] = []
    with listening(seen.append), stage("build", "Q4_K_M"):
        watch = LineWatch(quantize_line, every=0)
        log.write_text(QUANTIZE + "\n" + QUANTIZE.replace("  12/", " 100/") + "\r")
        watch.poll(str(log))
        watch.close()
    progress = [e for e in seen if e.phase == "progress"]
    assert progress and (progress[-1].stage, progress[-1].detail) == ("build", "Q4_K_M")
    assert progress[-1].done == 100 and progress[-1].total == 291
    text = describe(progress[-1], 60.0)
    assert text.startswith("100/291 tensors (34%), 1m00s, ETA 1m54s"), text


def test_a_log_gets_a_line_per_tenth_of_the_way() -> None:
    clock = Throttle(every=3600)
    clock.due(Event("evaluate", "Q8_0", "start"))
    said = [clock.due(Event("evaluate", "Q8_0", "progress", done=i, total=100, unit="windows"))
            for i in range(1, 101)]
    assert 10 <= sum(said) <= 12 and said[-1]


def test_a_run_shows_where_its_stages_are(tmp_path: Path, demo_model: Path) -> None:
    """The real tools' lines through a real run: llama.cpp's converter (the base), llama-quantize (tensor i of N),
    the reference's and the evaluation's runners (window i of N)."""
    result = CliRunner().invoke(app, ["convert", str(demo_model), "--gguf", "Q4_K_M", "--name", "p", "--registry",
                                      str(tmp_path / "reg"), "--no-speed", "--max-windows", "2"],
                                env={"QUANTYARD_WORK_DIR": str(tmp_path / "work")})
    assert result.exit_code == 0, result.output
    err = result.stderr
    assert "build Q4_K_M: 39/39 tensors (100%)" in err, err
    assert "reference: 2/2 windows (100%)" in err and "evaluate Q4_K_M: 2/2 windows (100%)" in err, err
    assert "tok/s" in err
    assert "note: reference: auto: transformers float32 on the CPU fits" in err
    assert "time and memory per stage" in result.stdout
    report = CliRunner().invoke(app, ["convert", str(demo_model), "--gguf", "Q4_K_M", "--name", "p", "--registry",
                                      str(tmp_path / "reg"), "--no-speed", "--max-windows", "2", "--json"],
                                env={"QUANTYARD_WORK_DIR": str(tmp_path / "work")})
    assert json.loads(report.stdout)["ledger_only"] is True  # a re-run chooses the same reference: all reused


def test_the_flow_writes_where_its_stages_are_to_prefects_log(tmp_path: Path, demo_model: Path, cache_dir: Path,
                                                              prefect_harness: None) -> None:
    """A long stage's progress also reaches the flow run's log on the Prefect server (the UI shows it), at INFO:
    what a worker logs by default (the embedded CLI keeps Prefect at WARNING, its console showing progress)."""
    import asyncio
    import logging

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    from flows.quantize import convert_flow
    from pipeline.plan import EvalSpec, Plan, SourceInput, SpeedSpec, variants_from_flags
    from tests.conftest import make_settings

    cfg = make_settings(tmp_path / "registry", tmp_path / "work", cache_dir)
    plan = Plan(source=SourceInput(source=str(demo_model)), model_name="logged", variants=variants_from_flags(
        gguf="Q4_K_M"), eval=EvalSpec(max_windows=2, speed=SpeedSpec(enabled=False)))
    prefect_logger = logging.getLogger("prefect")
    level = prefect_logger.level
    prefect_logger.setLevel(logging.INFO)
    try:
        state = convert_flow(plan, cfg, return_state=True)
    finally:
        prefect_logger.setLevel(level)
    assert state.is_completed(), state
    APILogWorker.drain_all()  # the log worker sends in batches: everything sent before reading
    run = state.state_details.flow_run_id

    async def read() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run])))
            return [log.message for log in logs]

    messages = asyncio.run(read())
    assert any(m.startswith("build Q4_K_M: 39/39 tensors (100%)") for m in messages), messages[:50]
    assert any(m.startswith("evaluate Q4_K_M: 2/2 windows (100%)") for m in messages), messages[:50]
