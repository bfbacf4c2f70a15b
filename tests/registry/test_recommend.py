"""``quantyard recommend`` on a real SQLite registry of SYNTHETIC serving results (tests/labelled_serving.py):
a memory budget that excludes some variants, the explanation of every exclusion, the Pareto ranking, the labelled
estimate, ``--json`` and the exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.cli.recommend import parse_bytes
from pipeline.errors import InvalidSpecError
from registry import open_registry
from registry.recommend import Recommendation, RecommendRequest, recommend
from tests.labelled_serving import MODEL, build_serving_registry

ASK = {"model": MODEL, "max_memory_bytes": 8 * 10**9, "context": 8192, "users": 16}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("recommend")
    return build_serving_registry(base / "registry", base / "files")


def run(registry: Path, **ask: object) -> Recommendation:
    return recommend(open_registry(str(registry)).latest_versions(MODEL), RecommendRequest(**{**ASK, **ask}))


def reasons(rec: Recommendation) -> dict[str, list[str]]:
    return {c.variant: c.reasons for c in rec.excluded}


def test_budget_slo_and_quality_exclude_with_reasons(registry: Path) -> None:
    rec = run(registry, max_kld=0.05, p99_ttft_ms=1000)
    why = reasons(rec)
    assert why["Q8_0"] == ["peak 9.10 GB > 8.00 GB"]
    assert why["EXL2-4.0bpw"] == ["no serving result"]
    assert any("measured at context 4,096 < 8,192" in r and "ESTIMATE" in r and "--allow-estimates" in r
               for r in why["AWQ-W4-G128-asym"])
    assert why["Q2_K"] == ["p99 TTFT 1.4 s > 1 s at 32 users", "KLD 0.4 > 0.05"]
    assert why["Q3_K_M"][0] == "3 of 200 requests failed at 32 users"
    assert why["IQ4_XS"] == ["KLD only a top-K lower bound (0.04): --max-kld needs the exact full-vocabulary KLD"]
    assert "memory measured with 8 users < 16: the measurement does not cover the ask" in why["Q6_K"]
    assert any("no load level with ≥ 16 users" in r for r in why["Q6_K"])


def test_survivors_are_ranked_by_the_pareto_front(registry: Path) -> None:
    rec = run(registry, max_kld=0.05, p99_ttft_ms=1000)
    assert [(c.rank, c.variant) for c in rec.ranked] == [(1, "Q5_K_M"), (1, "Q4_K_M"), (2, "Q4_K_S")]
    q4 = rec.ranked[1]
    assert (q4.kld, q4.peak_bytes, q4.level_users, q4.memory_source) == (0.03, 5_200_000_000, 32, "rss")
    assert q4.peak_is_estimate is False and q4.reasons == []
    assert "measured at 32 users, the smallest measured level ≥ 16" in q4.notes[0]
    assert rec.unranked == []


def test_a_tighter_budget_leaves_fewer(registry: Path) -> None:
    rec = run(registry, max_memory_bytes=int(5.3e9), max_kld=0.05)
    assert [c.variant for c in rec.ranked] == ["Q4_K_M"]
    assert "peak 6.00 GB > 5.30 GB" in reasons(rec)["Q5_K_M"]


def test_without_a_kld_limit_a_bound_fits_but_is_not_ranked(registry: Path) -> None:
    rec = run(registry)
    unranked = {c.variant: c for c in rec.unranked}
    assert "not ranked: no exact KLD (only a top-K lower bound)" in unranked["IQ4_XS"].notes
    assert all(c.kld is not None for c in rec.ranked)


def test_estimates_are_labelled_and_ranked_only_when_allowed(registry: Path) -> None:
    rec = run(registry, users=64, context=8192, allow_estimates=True)
    awq = next(c for c in rec.ranked if c.variant == "AWQ-W4-G128-asym")
    assert awq.peak_is_estimate and awq.peak_bytes == pytest.approx(5.125e9)  # 4.1 GB + its 1.025 GB KV cache × 2
    assert any(n.startswith("measured at context 4,096 < 8,192; memory is an ESTIMATE, not a measurement")
               for n in awq.notes)
    assert any("CPU-scaled load shape" in n for n in awq.notes) and any("dense-matmul" in n for n in awq.notes)
    assert set(awq.marks) == {"cpu-scaled", "dense-kernel"}
    assert "AWQ-W4-G128-asym" in reasons(run(registry, users=64))


def test_cli_json_and_exit_codes(registry: Path) -> None:
    args = ["recommend", MODEL, "--max-memory", "8G", "--context", "8192", "--users", "16", "--max-kld", "0.05",
            "--p99-ttft-ms", "1000", "--registry", str(registry)]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [c["name"] for c in data["ranked"]] == ["Q5_K_M on llama.cpp", "Q4_K_M on llama.cpp",
                                                    "Q4_K_S on llama.cpp"]
    assert {c["variant"] for c in data["excluded"]} >= {"Q8_0", "EXL2-4.0bpw", "IQ4_XS"}
    human = CliRunner().invoke(app, args)
    assert human.exit_code == 0 and "excluded Q8_0 on llama.cpp: peak 9.10 GB > 8.00 GB" in human.output
    none = CliRunner().invoke(app, [*args[:3], "1G", *args[4:]])
    assert none.exit_code == 1 and "no variant fits" in none.output


def test_parse_bytes() -> None:
    assert parse_bytes("8G") == parse_bytes("8GB") == 8 * 10**9
    assert parse_bytes("7.5GiB") == int(7.5 * 2**30) and parse_bytes("512M") == 512 * 10**6
    assert parse_bytes("1000") == 1000
    for bad in ("8X", "-1G", "0", "lots"):
        with pytest.raises(InvalidSpecError):
            parse_bytes(bad)
