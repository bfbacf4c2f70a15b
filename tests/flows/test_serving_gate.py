"""``validate``'s serving check against a policy SLO, on a real SQLite registry of SYNTHETIC serving results
(tests/labelled_serving.py): pass, fail (a limit, a missing figure, failed requests), skip (no SLO, no version,
no result at that concurrency), the measured value printed next to its limit; and the policy file's
``serving:`` key."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.serving_gate import check_serving
from pipeline.checks import CheckFailed, CheckSkipped, ValidationReport
from pipeline.errors import ConfigError
from pipeline.policy import ServingSLO, load_policy
from registry import open_registry
from registry.views import VersionView
from tests.labelled_serving import MODEL, build_serving_registry


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, VersionView]:
    base = tmp_path_factory.mktemp("serving-gate")
    reg = open_registry(str(build_serving_registry(base / "registry", base / "files")))
    return {v.variant: v for v in reg.latest_versions(MODEL)}


def test_passes_with_the_measured_values_beside_the_limits(versions: dict[str, VersionView]) -> None:
    # Q4_K_M at 8 users (synthetic): p99 TTFT 40 × 1.5 = 60 ms, p99 ITL 14 × 1.25 = 17.5 ms
    message, details = check_serving(versions["Q4_K_M"], ServingSLO(concurrency=8, p99_ttft_ms=1000, p99_itl_ms=50))
    assert "8 users on llama-server SYNTHETIC (llama.cpp), seed profile" in message
    assert "p99 TTFT 60 ms ≤ 1000 ms: ok" in message and "p99 ITL 17.5 ms ≤ 50 ms: ok" in message
    assert "failed requests 0/200 (0 %) ≤ 0 %: ok" in message
    assert details["level"]["concurrency"] == 8 and details["cpu_scaled"] is False


def test_fails_on_a_limit_and_says_by_how_much(versions: dict[str, VersionView]) -> None:
    with pytest.raises(CheckFailed) as info:
        check_serving(versions["Q2_K"], ServingSLO(concurrency=32, p99_ttft_ms=1000))
    assert "p99 TTFT 1400 ms > 1000 ms" in str(info.value) and "p99 TTFT 1400 ms ≤ 1000 ms: FAIL" in str(info.value)


def test_fails_on_failed_requests_and_on_a_throughput_floor(versions: dict[str, VersionView]) -> None:
    with pytest.raises(CheckFailed, match="3 of 200 requests failed"):
        check_serving(versions["Q3_K_M"], ServingSLO(concurrency=32, p99_ttft_ms=1000))
    check_serving(versions["Q3_K_M"], ServingSLO(concurrency=32, p99_ttft_ms=1000, max_failed_pct=2))
    with pytest.raises(CheckFailed, match=r"output throughput .* tok/s < 100000 tok/s"):
        check_serving(versions["Q4_K_M"], ServingSLO(concurrency=8, min_output_throughput=100_000))


def test_never_passes_on_a_missing_figure(versions: dict[str, VersionView]) -> None:
    import json

    view = versions["Q4_K_M"]
    metrics = json.loads(json.dumps(view.results[-1].metrics))
    for lv in metrics["levels"]:
        lv["itl_ms"] = None
    stripped = view.model_copy(update={"results": [view.results[-1].model_copy(update={"metrics": metrics})]})
    with pytest.raises(CheckFailed, match=r"p99 ITL not measured \(needed by p99_itl_ms 50 ms\)"):
        check_serving(stripped, ServingSLO(concurrency=8, p99_ttft_ms=1000, p99_itl_ms=50))


def test_labels_cpu_scaled_shapes_and_the_replaced_kernel(versions: dict[str, VersionView]) -> None:
    message, details = check_serving(versions["AWQ-W4-G128-asym"], ServingSLO(concurrency=1, p99_ttft_ms=10_000))
    assert "CPU-scaled load shape (CPU: scaled from the seed shape 512/256" in message
    assert "vLLM's 4-bit kernel replaced by a dense matmul" in message
    assert details["cpu_scaled"] is True and details["kernel"].startswith("dequantized")


def test_skips_with_the_reason(versions: dict[str, VersionView]) -> None:
    cases = [(versions["Q4_K_M"], None, "the policy sets no serving SLO"),
             (None, ServingSLO(concurrency=8), "a plain file has no serving result"),
             (versions["Q6_K"], ServingSLO(concurrency=32), "has no serving result at 32 concurrent users "
                                                             "(measured levels: 1, 8)"),
             (versions["EXL2-4.0bpw"], ServingSLO(concurrency=8), "(measured levels: none)")]
    for version, slo, reason in cases:
        with pytest.raises(CheckSkipped, match=reason.replace("(", r"\(").replace(")", r"\)")):
            check_serving(version, slo)


def test_the_report_shows_skip_pass_and_fail(versions: dict[str, VersionView]) -> None:
    report = ValidationReport(target=MODEL)
    slo = ServingSLO(concurrency=32, p99_ttft_ms=1000)
    for name in ("Q6_K", "Q4_K_M", "Q2_K"):
        report.run(f"serving {name}", lambda name=name: check_serving(versions[name], slo))
    assert [c.status for c in report.checks] == ["skip", "pass", "fail"] and not report.passed
    assert report.checks[2].details["gates"][0] == "p99 TTFT 1400 ms ≤ 1000 ms: FAIL"


def test_policy_file_serving_key(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("serving: {concurrency: 8, p99_ttft_ms: 1000, p99_itl_ms: 50}\n")
    slo = load_policy(path).serving
    assert slo == ServingSLO(concurrency=8, p99_ttft_ms=1000, p99_itl_ms=50)
    assert load_policy(None).serving is None
    path.write_text("classes: {Q4: {max_kld: 0.03}}\n")
    assert load_policy(path).serving is None
    for bad in ("serving: {p99_ttft_ms: 1000}\n", "serving: {concurrency: 0}\n", "serving: {concurrency: 8, x: 1}\n",
                "serving: 8\n"):
        path.write_text(bad)
        with pytest.raises(ConfigError):
            load_policy(path)
