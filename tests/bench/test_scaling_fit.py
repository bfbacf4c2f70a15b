"""bench/scaling.py's cost model: the least-squares line, its labelled extrapolations and the job estimate.
Pure functions on synthetic points: nothing is measured here."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench import load_script


@pytest.fixture(scope="module")
def sc() -> ModuleType:
    return load_script("scaling")


def test_known_points_recover_known_coefficients(sc: ModuleType) -> None:
    xs = [5e6, 1.35e8, 7.7e8]
    fit = sc.fit_line(xs, [3.0 + 2e-8 * x for x in xs], "time of build", "P")
    assert fit.a == pytest.approx(3.0, rel=1e-9)
    assert fit.b == pytest.approx(2e-8, rel=1e-9)
    assert max(abs(r) for r in fit.residuals()) < 1e-9


def test_noisy_points_give_the_least_squares_line_and_its_residuals(sc: ModuleType) -> None:
    fit = sc.fit_line([0.0, 1.0, 2.0], [0.0, 2.0, 1.0], "y")  # normal equations: a = 0.5, b = 0.5
    assert (fit.a, fit.b) == (pytest.approx(0.5), pytest.approx(0.5))
    assert fit.residuals() == pytest.approx((-0.5, 1.0, -0.5))


def test_huge_x_values_stay_well_conditioned(sc: ModuleType) -> None:
    xs = [4.3e10, 1.1e12, 6.3e12]  # P·T at the three sizes
    fit = sc.fit_line(xs, [12.0 + 3.2e-11 * x for x in xs], "time of reference", "P·T")
    assert fit.a == pytest.approx(12.0, rel=1e-6)
    assert fit.b == pytest.approx(3.2e-11, rel=1e-9)


@pytest.mark.parametrize("xs", [[1e8], [1e8, 1e8, 1e8], []])
def test_an_underdetermined_fit_raises_a_clear_error(sc: ModuleType, xs: list[float]) -> None:
    with pytest.raises(sc.UnderdeterminedFitError, match="at least 2 distinct x values") as info:
        sc.fit_line(xs, [1.0] * len(xs), "time of hash")
    assert isinstance(info.value, ValueError)
    assert "time of hash" in str(info.value)


def test_mismatched_lengths_raise(sc: ModuleType) -> None:
    with pytest.raises(ValueError, match="as many y values"):
        sc.fit_line([1.0, 2.0], [1.0], "y")


def test_extrapolations_are_labelled(sc: ModuleType) -> None:
    fit = sc.fit_line([1e7, 1e8, 1e9], [1.0, 10.0, 100.0], "time of convert")
    far = sc.extrapolate(fit, 8e9, "8B", "s", count=6)
    assert far.label == "EXTRAPOLATED"
    assert far.value == pytest.approx(6 * 800.0)
    assert "EXTRAPOLATED" in str(far)
    assert sc.extrapolate(fit, 5e8, "mid", "s").label == "INTERPOLATED"


def _fits(sc: ModuleType) -> dict:
    xs = [5e6, 1.35e8, 7.7e8]
    line = sc.fit_line(xs, [1.0 + 1e-8 * x for x in xs], "time", "P")
    tok = sc.fit_line([x * 8192 for x in xs], [2.0 + 1e-10 * x * 8192 for x in xs], "time", "P·T")
    mem = sc.fit_line(xs, [1e9 + 4.0 * x for x in xs], "memory", "P")  # 1 GB + 4 B/param
    return {g: (tok if g in sc.TOKEN_STAGES else line, mem) for g, _, _ in sc.JOB_STAGES}


def test_job_estimate_counts_types_labels_everything_and_checks_memory(sc: ModuleType) -> None:
    job, gpu = sc.Job(), sc.GpuModel()
    target = sc.Target("8B", 8e9, 128256)
    rows = sc.job_estimate(_fits(sc), target, job, 24 * sc.GIB, gpu)
    assert [r.count for r in rows] == [1, 1, 1, 6, 6, 1, 6, 1]
    assert all(r.time.label == r.peak.label == "EXTRAPOLATED" for r in rows)
    evaluate = rows[6]
    assert evaluate.time.value == pytest.approx(6 * (2.0 + 1e-10 * 8e9 * 32768))
    assert evaluate.peak.value == pytest.approx((1e9 + 32e9) / sc.GIB)  # GiB
    assert not evaluate.fits_ram  # 30.7 GiB > 24 GiB
    assert rows[0].gpu_s is None and evaluate.gpu_s is not None


def test_job_estimate_names_a_missing_group(sc: ModuleType) -> None:
    fits = _fits(sc)
    del fits["reference"]
    with pytest.raises(KeyError, match="reference"):
        sc.job_estimate(fits, sc.Target("8B", 8e9, 128256), sc.Job(), 24 * sc.GIB, sc.GpuModel())


def test_gpu_estimate_is_compute_bound_at_512_token_windows(sc: ModuleType) -> None:
    gpu = sc.GpuModel()
    secs = sc.gpu_estimate_s(gpu, "reference", 8e9, 32768)
    compute = 2 * 8e9 * 32768 / (gpu.peak_flops * gpu.flops_fraction)
    assert secs == pytest.approx(8e9 * 2 / gpu.load_bps + compute)
    assert sc.gpu_estimate_s(gpu, "build", 8e9, 0) is None


def test_fit_groups_pools_the_types_and_reports_what_it_cannot_fit(sc: ModuleType) -> None:
    def run(size: str, params: int, k: float) -> object:
        stages = {"hash": sc.StageRun(k, 1e9 * k, 0), "build:Q8_0": sc.StageRun(2 * k, 2e9, 0),
                  "build:Q2_K": sc.StageRun(4 * k, 3e9, 0), "reference": sc.StageRun(5 * k, 4e9, 8192)}
        return sc.SizeRun(size, f"/{size}", params, 16, stages, 20 * k, 4e9)

    runs = [run("demo", 5_000_000, 1.0), run("real", 135_000_000, 3.0)]
    fits, missing = sc.fit_groups(runs)
    assert fits["build"][0].ys == (3.0, 9.0)  # the mean over the types
    assert fits["build"][1].ys == (3e9, 3e9)  # the largest peak
    assert fits["reference"][0].x_name == "P·T"
    assert not missing
    _, missing = sc.fit_groups(runs[:1])
    assert "at least 2 distinct" in missing["hash"]
    text = "\n".join(sc.report(runs[:1], 24 * sc.GIB, sc.GpuModel(), sc.Job()))
    assert "No extrapolation" in text and "EXTRAPOLATED" not in text


def test_every_number_of_a_target_is_labelled(sc: ModuleType) -> None:
    def run(size: str, params: int) -> object:
        stages = {g if g not in sc.PER_TYPE else f"{g}:Q8_0": sc.StageRun(1 + params * 1e-8, 1e9 + 4 * params,
                                                                          8192 if g in sc.TOKEN_STAGES else 0)
                  for g, _, _ in sc.JOB_STAGES}
        return sc.SizeRun(size, f"/{size}", params, 16, stages, 60.0, 3e9)

    runs = [run("demo", 5_000_000), run("real", 135_000_000), run("big", 770_000_000)]
    parts = sc.report(runs, 24 * sc.GIB, sc.GpuModel(), sc.Job())
    targets = [p for p in parts if p.startswith("### 8B") or p.startswith("### 70B")]
    assert len(targets) == 2
    for part in targets:
        rows = [line for line in part.splitlines() if line.startswith("| ") and not line.startswith("| stage")]
        assert rows and all("EXTRAPOLATED" in line for line in rows)
        assert "32,768 tokens" in part
    assert "ESTIMATE" in parts[-3] and "Assumption" in parts[-3]


def test_a_flat_or_falling_fit_never_extrapolates_below_what_was_measured(sc: ModuleType) -> None:
    fit = sc.fit_line([1e6, 1e8, 1e9], [0.031, 0.029, 0.030], "time of resolve")  # noise around a constant
    assert fit.b <= 0
    far = sc.extrapolate(fit, 7e10, "70B", "s")
    assert far.value == pytest.approx(0.031) and far.label.startswith("EXTRAPOLATED flat")
    assert "EXTRAPOLATED" in str(far)
    assert sc.extrapolate(fit, 5e8, "mid", "s").label == "INTERPOLATED"  # inside the range: the line itself


def _gpu_json(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"machine": {"gpu": "NVIDIA H200"}, "rows": rows}))
    return path


def _gpu_row(size: str, params: float, eval_s: float, start: float, device: str = "cuda") -> dict:
    return {"size": size, "params": params, "tokens": 8192, "scored": 4080, "vocab": 128256, "eval_s": eval_s,
            "load_and_start_s": start, "stage_wall_s": eval_s + start, "device": device}


def test_gpu_measurement_sets_the_host_rate_and_start_of_the_gpu_column(sc: ModuleType, tmp_path: Path) -> None:
    entries = 4080 * 128256
    rows = [_gpu_row("b", 1.5e9, 9.0, 18.0), _gpu_row("a", 0.3e9, 10.0, 16.0), _gpu_row("c", 3.6e9, 12.0, 17.0),
            _gpu_row("cpu", 1e6, 99.0, 1.0, device="cpu")]  # a CPU dry run's row is not a GPU measurement
    measured = sc.GpuMeasured.load(_gpu_json(tmp_path, rows))
    assert measured.host_s_per_entry == pytest.approx(10.0 / entries)  # the median, not the mean
    assert measured.start_s == 16.0 and measured.params == (1.5e9, 0.3e9, 3.6e9)
    plain, gpu = sc.GpuModel(), sc.GpuModel(measured=measured)
    job, target = sc.Job(), sc.Target("8B", 8e9, 128256)
    more = job.scored * target.vocab
    for stage in ("reference", "evaluate"):
        with_host = sc.gpu_estimate_s(gpu, stage, 8e9, job.tokens, entries=more)
        without = sc.gpu_estimate_s(plain, stage, 8e9, job.tokens)
        assert with_host == pytest.approx(without + 16.0 + more * 10.0 / entries)
    assert sc.gpu_estimate_s(gpu, "build", 8e9, 0, entries=more) is None
    assert "MEASURED on NVIDIA H200" in gpu.assumption() and "ASSUMED equal" in gpu.assumption()
    assert len(gpu.check()) == 2 + 4 - 1 and plain.check() == []


def test_a_gpu_file_without_gpu_rows_is_refused(sc: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no GPU measurement"):
        sc.GpuMeasured.load(_gpu_json(tmp_path, [_gpu_row("cpu", 1e6, 1.0, 1.0, device="cpu")]))


def test_the_sources_parts_replace_its_whole_event_in_the_job_when_all_are_fitted(sc: ModuleType) -> None:
    """The checks are a fixed cost and the hash and the scan grow with the bytes: with the parts fitted the job
    is extrapolated from them; a measurement file from before the parts keeps the whole event's row."""
    def run(size: str, params: int, parts: bool) -> object:
        stages = {g if g not in sc.PER_TYPE else f"{g}:Q8_0": sc.StageRun(1 + params * 1e-8, 1e9 + 4 * params,
                                                                          8192 if g in sc.TOKEN_STAGES else 0)
                  for g, _, _ in sc.JOB_STAGES}
        if parts:
            stages |= {"source:hash": sc.StageRun(params * 1e-9, 1e9, 0),
                       "source:check": sc.StageRun(3.0, 1e9, 0),  # flat: imports and a model on the meta device
                       "source:scan": sc.StageRun(params * 2e-10, 1e9, 0)}
        return sc.SizeRun(size, f"/{size}", params, 16, stages, 60.0, 3e9)

    sizes = (("demo", 5_000_000), ("real", 135_000_000), ("big", 770_000_000))
    target, job = sc.Target("70B", 70e9, 128256), sc.Job()
    for parts in (True, False):
        fits, _ = sc.fit_groups([run(n, p, parts) for n, p in sizes])
        rows = {r.what: r for r in sc.job_estimate(fits, target, job, 24 * sc.GIB, sc.GpuModel())}
        assert ("hash the source" in rows) is not parts
        if parts:
            assert rows["hash the source (content hash of its files)"].time.value == pytest.approx(70.0)
            assert rows["check the source (config, shapes, tokenizer, formats)"].time.value == pytest.approx(3.0)
            assert rows["scan every weight for NaN/Inf"].time.value == pytest.approx(14.0)
