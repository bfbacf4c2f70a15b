"""Run one GuideLLM benchmark and write its per-request records. Runs in the ``guidellm`` tool environment.

``python -m evaluators.serving.guidellm_runner REQUEST.json``, where the request (written by
``evaluators.serving.load``) holds:

* ``scenario``: a GuideLLM 0.8.1 scenario (``BenchmarkScenario``: ``spec`` with backend, profile,
  constraints, tokenizer, data, seed, outputs), run exactly as ``guidellm run --scenario FILE`` runs it;
* ``tokenizer``: the tokenizer folder GuideLLM makes its prompts with, used here again to count the tokens of
  each received text (the client's count);
* ``timeout_s``: the per-request deadline (see ``evaluators.serving.guidellm_backend``);
* ``result``: where to write the result.

The result (JSON): ``{"guidellm_version", "report", "requests": [...]}`` with one entry per request in
GuideLLM's report (successful, errored and incomplete alike): ``status``, GuideLLM's own timestamps
(``request_start``, ``first_token``, ``last_token``, ``request_end``, and ``targeted_start``, when its
schedule meant to send the request; Unix seconds, ``time.time()``),
``token_times`` (every content chunk's arrival, recorded by the backend wrapper; empty where the request
failed before GuideLLM compiled a response), ``usage`` (the server's raw usage, ``None`` when it sent
none), ``output_tokens_client`` and ``error``. No metric is computed here: ``evaluators.serving.metrics``
does that from these records. Imports only the standard library, GuideLLM and transformers.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from pipeline.fs import write_atomic

STATUSES = ("successful", "errored", "incomplete")


def run_guidellm(scenario_path: Path) -> None:
    """``guidellm run --scenario FILE --disable-console-interactive``, in this process, with the backend
    that records chunk arrival times installed first."""
    from guidellm.cli import cli

    from evaluators.serving import guidellm_backend

    guidellm_backend.install()
    cli.main(["run", "--scenario", str(scenario_path), "--disable-console-interactive"], standalone_mode=False)


def _client_counter(tokenizer: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def request_entry(stats: dict[str, Any], status: str, count: Any) -> dict[str, Any]:
    """One request of GuideLLM's report as the plain record the driver converts."""
    info = stats.get("info") or {}
    timings = info.get("timings") or {}
    ours = (stats.get("response_metrics") or {}).get("quantyard") or {}
    text = stats.get("output")
    error = info.get("error")
    if status == "incomplete" and error is None:
        error = "cancelled before it completed"
    return {"status": status, "request_id": stats.get("request_id"),
            "request_start": timings.get("request_start") or timings.get("resolve_start"),
            "targeted_start": timings.get("targeted_start"),
            "first_token": timings.get("first_token_iteration"), "last_token": timings.get("last_token_iteration"),
            "request_end": timings.get("request_end"), "chunks": timings.get("token_iterations"),
            "token_times": list(ours.get("token_times") or []), "usage": ours.get("usage"),
            "output_tokens_client": count(text) if isinstance(text, str) else None, "error": error}


def read_report(report: Path, tokenizer: str) -> list[dict[str, Any]]:
    """Every request of the (single) benchmark in GuideLLM's JSON report, in report order."""
    data = json.loads(report.read_text())
    benchmarks = data.get("benchmarks") or []
    if len(benchmarks) != 1:
        raise ValueError(f"expected one benchmark in {report}, found {len(benchmarks)}")
    count = _client_counter(tokenizer)
    groups = benchmarks[0].get("requests") or {}
    return [request_entry(stats, status, count) for status in STATUSES for stats in groups.get(status) or []]


def _report_path(scenario: dict[str, Any]) -> Path:
    outputs = [o for o in scenario["spec"].get("outputs", []) if o.get("kind") == "json"]
    if len(outputs) != 1:
        raise ValueError("the scenario must name exactly one json output")
    return Path(outputs[0]["path"])


def main(request_path: str) -> int:
    from importlib.metadata import version

    request = json.loads(Path(request_path).read_text())
    scenario, result = request["scenario"], Path(request["result"])
    scenario_path = result.with_name("scenario.json")
    write_atomic(scenario_path, json.dumps(scenario, indent=1))
    os.environ["QUANTYARD_REQUEST_TIMEOUT_S"] = str(request["timeout_s"])
    run_guidellm(scenario_path)
    report = _report_path(scenario)
    requests = read_report(report, request["tokenizer"])
    write_atomic(result, json.dumps({"guidellm_version": version("guidellm"), "report": str(report),
                                     "requests": requests}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
