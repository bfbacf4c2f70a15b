#!/usr/bin/env python3
"""Install llama-cpp-python (with the llama.cpp tools) into a venv, from a cached wheel.

PyPI has no prebuilt llama-cpp-python wheel, so the wheel is built once from the
pinned sdist and cached outside the repository, keyed by version, by the CPU it
was compiled for (the build uses -march=native, so a wheel only suits the same
CPU kind) and by the build options (CMake flags, compiler flags, the patches).
The build is cut to what Quantyard runs: the sdist is extracted and the llama.cpp
tools no code here uses are left out (DROPPED_TOOLS), and it is a CMake unity
build (UNITY_SKIP). Its progress is printed every 30 s, its output kept in
CACHE/logs/llama-cpp-python-VERSION-build.log.

The same sdist also provides llama.cpp's own HF->GGUF converter
(`convert_hf_to_gguf.py`, `conversion/`, and the matching `gguf-py/`). They are
extracted into the cache, never into the repository.

Usage: bootstrap_llama_cpp.py VENV_PYTHON
       bootstrap_llama_cpp.py --wheel-only

--wheel-only builds (or finds) the cached wheel and installs nothing. It needs no venv: the build runs in
pip's build isolation and the wheel is py3-none (ctypes), so any Python 3 with pip builds the same wheel.
`make` starts it first, in the background, so that llama.cpp compiles while the core environment installs.

Only the standard library is used: this runs before the venv is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

# pipeline.cpu and pipeline.fs are standard-library only; with --wheel-only this runs under a Python without the
# project installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.cpu import cpu_flags
from pipeline.fs import exclusive

VERSION = "0.3.36"
# The tools (llama-quantize, llama-imatrix, llama-perplexity...) and llama-server, which a sub-project build
# leaves out by default. The server's web UI is off: its prebuilt assets would be downloaded from Hugging Face
# at build time (LLAMA_USE_PREBUILT_UI, on by default) and building it needs npm; the OpenAI API needs neither.
# A CMake unity build (several sources compiled as one: each header parsed once per batch, not once per file);
# with DROPPED_TOOLS left out it took 0.645 of the plain build's time on 2 cores (bench/llama_cpp_build.py; see
# UNITY_SKIP for the sources it cannot take).
CMAKE_ARGS = ("-DLLAMA_BUILD_TOOLS=ON -DLLAMA_TOOLS_INSTALL=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_SERVER=ON "
              "-DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_UNITY_BUILD=ON")
#: llama.cpp tools no part of Quantyard runs, left out of the build: their ``add_subdirectory`` lines in the
#: extracted sdist's ``tools/CMakeLists.txt`` are commented out. Built: llama-quantize, llama-perplexity,
#: llama-imatrix, llama-bench, llama-batched-bench, llama-gguf-split and llama-server (with the mtmd library it
#: links). tests/scripts/test_bootstrap_llama_cpp.py checks that no code names a binary of a dropped tool.
DROPPED_TOOLS = ("cli", "completion", "cvector-generator", "export-lora", "fit-params", "results", "tokenize",
                 "tts")
#: Sources a unity build cannot take, compiled on their own (SKIP_UNITY_BUILD_INCLUSION, appended to their
#: folder's CMakeLists.txt): common/json.cpp specializes a template that an earlier file of its batch has
#: instantiated; mtmd-helper*.cpp refuse, by #error, to be compiled with mtmd's internal headers.
UNITY_SKIP = {"common": ("json.cpp",), "tools/mtmd": ("mtmd-helper.cpp", "mtmd-helper-gen.cpp")}
REPO = Path(__file__).resolve().parent.parent
#: Compiler flags that keep llama.cpp's AMX kernels out of a -march=native build (GCC lets an explicit -mno-*
#: win over what -march=native implies, whatever the order).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
#: Why a CPU with AMX builds without it unless QUANTYARD_LLAMA_AMX=on: with this pinned release, llama.cpp's
#: AMX matmul (ggml-cpu/amx, compiled in when -march=native finds AMX) died at its first tile instruction on
#: the AMX machine it was run on (Xeon with amx_tile/amx_int8/amx_bf16, 2026-12-02: SIGILL at `tilezero` inside
#: ggml_backend_amx_mul_mat, SIGSEGV outside a debugger), for every Q8_0 and Q4_K_M file, llama-perplexity
#: included, while a stand-alone AMX probe ran; the same files ran with AMX left out (AVX-512/VNNI kernels).
AMX_REASON = ("llama.cpp's AMX matmul faulted (SIGILL at tilezero) with llama-cpp-python 0.3.36 on an AMX Xeon; "
              "QUANTYARD_LLAMA_AMX=on builds it in anyway")


def log(msg: str) -> None:
    print(f"[bootstrap-llama-cpp] {msg}", flush=True)


def cache_root() -> Path:
    env = os.environ.get("QUANTYARD_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "quantyard"


def locked_sdist_sha() -> str:
    lock = (REPO / "requirements" / "llama-cpp.lock").read_text()
    match = re.search(r"sha256=([0-9a-f]{64})", lock)
    if not match:
        raise SystemExit("requirements/llama-cpp.lock has no sha256= line")
    return match.group(1)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cpu_key(cpuinfo: str | None = None) -> str:
    """A short key for 'wheels built here run here': arch, CPU model, ISA flags, compiler, Python.

    The build compiles with -march=native, so a wheel built on an AVX-512 CPU dies with SIGILL on an
    AVX2-only one (and one built on AVX2 leaves AVX-512 unused): every flag is part of the key, sorted
    so that only the set counts. ``cpuinfo``: the text of /proc/cpuinfo (read when None).
    """
    parts = [platform.machine(), sys.version_info[:2].__repr__()]
    try:
        info = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
        for field in ("model name", "flags", "Features"):
            m = re.search(rf"^{field}\s*:\s*(.*)$", info, re.M)
            if m:
                parts.append(" ".join(sorted(m.group(1).split())))
    except OSError:
        parts.append(platform.processor())
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc:
        parts.append(subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0])
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def amx_choice(cpuinfo: str | None = None, env: dict[str, str] | None = None) -> tuple[str, str]:
    """Whether the build keeps llama.cpp's AMX kernels, and why: ``("absent", ...)`` on a CPU without AMX,
    ``("off", AMX_REASON)`` on one with it (the default, see :data:`AMX_REASON`), ``("on", ...)`` when
    ``QUANTYARD_LLAMA_AMX=on`` asks for them. ``cpuinfo``/``env``: /proc/cpuinfo's text and the environment
    (read when None)."""
    environ = os.environ if env is None else env
    want = environ.get("QUANTYARD_LLAMA_AMX", "auto").strip().lower()
    if want not in ("auto", "on", "off"):
        raise SystemExit(f"QUANTYARD_LLAMA_AMX must be auto, on or off; found {want!r}")
    has_amx = "amx_tile" in cpu_flags(cpuinfo).split()  # every AMX CPU has the tile unit
    if not has_amx:
        return "absent", "this CPU has no AMX"
    if want == "on":
        return "on", "QUANTYARD_LLAMA_AMX=on"
    return "off", (AMX_REASON if want == "auto" else "QUANTYARD_LLAMA_AMX=off")


def compile_flags(cpuinfo: str | None = None, env: dict[str, str] | None = None) -> str:
    """CFLAGS/CXXFLAGS of the build on this CPU: :data:`NO_AMX` when :func:`amx_choice` says off, else ''."""
    return NO_AMX if amx_choice(cpuinfo, env)[0] == "off" else ""


def source_patches() -> list[str]:
    """The changes :func:`patch_source` makes to the sdist's llama.cpp, as words of the build key."""
    skips = [f"{folder}/{name}" for folder, names in sorted(UNITY_SKIP.items()) for name in names]
    return ["DROP:", *sorted(DROPPED_TOOLS), "UNITY_SKIP:", *skips]


def build_key(cmake_args: str = CMAKE_ARGS, cflags: str | None = None,
              patches: list[str] | None = None) -> str:
    """A short key of the build options: a wheel built with other CMake flags (without llama-server, say), other
    compiler flags (AMX left out, or not) or another set of dropped tools is another wheel. ``cflags``:
    :func:`compile_flags` when None; ``patches``: :func:`source_patches` when None."""
    flags = compile_flags() if cflags is None else cflags
    words = sorted(cmake_args.split()) + (["CFLAGS:", *sorted(flags.split())] if flags else [])
    words += source_patches() if patches is None else patches
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:8]


def patch_source(llama_cpp: Path) -> None:
    """Leave :data:`DROPPED_TOOLS` out of the extracted sdist's llama.cpp (folder ``llama_cpp``) and compile
    :data:`UNITY_SKIP` on their own. Fails (SystemExit) where the sources are not as this script expects."""
    tools = llama_cpp / "tools" / "CMakeLists.txt"
    text = tools.read_text()
    for name in DROPPED_TOOLS:
        line = re.compile(rf"^(\s*)(add_subdirectory\({re.escape(name)}\))\s*$", re.M)
        found = len(line.findall(text))
        if found != 1:
            raise SystemExit(f"{tools}: expected one 'add_subdirectory({name})' line, found {found}; "
                             "update DROPPED_TOOLS")
        text = line.sub(r"\1# not built (scripts/bootstrap_llama_cpp.py DROPPED_TOOLS): \2", text)
    tools.write_text(text)
    for folder, names in UNITY_SKIP.items():
        cmake = llama_cpp / folder / "CMakeLists.txt"
        missing = [n for n in names if not (cmake.parent / n).is_file()]
        if missing:
            raise SystemExit(f"{cmake.parent}: expected {missing}; update UNITY_SKIP")
        with cmake.open("a") as fh:
            fh.write(f"\n# scripts/bootstrap_llama_cpp.py UNITY_SKIP\n"
                     f"set_source_files_properties({' '.join(names)} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)\n")


def wheel_dir(cache: Path) -> Path:
    """Where the wheel for this version, CPU and build options is cached."""
    return cache / "wheels" / f"llama-cpp-python-{VERSION}-{cpu_key()}-{build_key()}"


def ensure_sdist(cache: Path) -> Path:
    want = locked_sdist_sha()
    sdist = cache / "sdist" / f"llama_cpp_python-{VERSION}.tar.gz"
    if sdist.exists() and sha256_file(sdist) == want:
        return sdist
    sdist.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=sdist.parent) as tmp:
        log(f"downloading llama-cpp-python=={VERSION} sdist")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             f"llama-cpp-python=={VERSION}", "-d", tmp],
            check=True,
        )
        got = Path(tmp) / sdist.name
        digest = sha256_file(got)
        if digest != want:
            raise SystemExit(f"sdist sha256 mismatch: expected {want}, got {digest}; refusing to build it")
        os.replace(got, sdist)
    return sdist


#: Seconds between two progress lines of the build.
PROGRESS_S = 30.0
STEP = re.compile(r"\[(\d+)/(\d+)\]")


def run_build(cmd: list[str], env: dict[str, str], log_path: Path) -> None:
    """Run the wheel build, its whole output to ``log_path``, and print its progress (ninja's ``[done/total]``
    steps) every :data:`PROGRESS_S` seconds. Fails (SystemExit, with the log's tail) when the build does."""
    t0 = last = time.monotonic()
    done = total = 0
    with log_path.open("w") as log_fh:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            log_fh.write(line)
            m = STEP.search(line)
            if m:
                done, total = max(done, int(m.group(1))), int(m.group(2))
            now = time.monotonic()
            if now - last >= PROGRESS_S:
                last = now
                steps = f"{done}/{total} compile steps" if total else "configuring"
                log(f"building: {steps}, {(now - t0) / 60:.1f} min")
        code = proc.wait()
    if code != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"{tail}\nthe llama-cpp-python build failed (exit {code}); its whole output: {log_path}")
    log(f"built in {(time.monotonic() - t0) / 60:.1f} min")


def build_wheel(sdist: Path, tmp: Path, python: str, log_path: Path, *, quantyard: bool = True) -> Path:
    """Unpack ``sdist`` under ``tmp`` and build its wheel there with ``python``'s pip, every core, this CPU's
    compiler flags; returns the wheel. ``quantyard``: the build Quantyard installs (``patch_source``: the tools
    it never runs left out; a CMake unity build); False: the sdist's own build, all tools, one compile per
    source file (what bench/llama_cpp_build.py compares it with)."""
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp, filter="data")
    source = tmp / f"llama_cpp_python-{VERSION}"
    args = CMAKE_ARGS
    if quantyard:
        patch_source(source / "vendor" / "llama.cpp")
    else:
        args = " ".join(a for a in args.split() if a != "-DCMAKE_UNITY_BUILD=ON")
    env = dict(os.environ, CMAKE_ARGS=args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    cflags = compile_flags()
    if cflags:
        env["CFLAGS"] = f"{env.get('CFLAGS', '')} {cflags}".strip()
        env["CXXFLAGS"] = f"{env.get('CXXFLAGS', '')} {cflags}".strip()
    out = tmp / "out"
    run_build([python, "-m", "pip", "wheel", "--no-deps", "-v", str(source), "-w", str(out)], env, log_path)
    built = sorted(out.glob("*.whl"))
    if len(built) != 1:
        raise SystemExit(f"expected one wheel from the build, found {built}")
    return built[0]


def ensure_wheel(cache: Path, sdist: Path, venv_python: str) -> Path:
    """The cached wheel, built if missing. One build at a time per wheel folder (an ``flock`` beside it): a
    second setup started meanwhile (``make demo`` in another checkout, or the install step after
    ``--wheel-only``) waits for it and reuses the wheel."""
    folder = wheel_dir(cache)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(folder.parent / f".{folder.name}.lock",
                   on_wait=lambda: log("another setup is building this wheel: waiting for it")):
        return _ensure_wheel_locked(cache, sdist, venv_python, folder)


def _ensure_wheel_locked(cache: Path, sdist: Path, venv_python: str, folder: Path) -> Path:
    wheels = sorted(folder.glob("*.whl"))
    if wheels:
        log(f"reusing cached wheel {wheels[0]}")
        return wheels[0]
    log("building llama-cpp-python from source with the llama.cpp tools Quantyard runs (about 5 minutes on 2 "
        f"cores; left out: {', '.join(DROPPED_TOOLS)})")
    amx, why = amx_choice()
    cflags = compile_flags()
    log(f"AMX kernels: {amx} ({why})" + (f"; CFLAGS/CXXFLAGS {cflags}" if cflags else ""))
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        built = build_wheel(sdist, Path(tmp), venv_python, logs / f"llama-cpp-python-{VERSION}-build.log")
        staged = Path(tmp) / "staged"
        staged.mkdir()
        shutil.move(str(built), staged / built.name)
        (staged / "build.json").write_text(json.dumps(
            {"cmake_args": CMAKE_ARGS, "cflags": cflags, "amx": amx, "amx_reason": why,
             "dropped_tools": list(DROPPED_TOOLS), "unity_skip": UNITY_SKIP}, indent=2))
        os.replace(staged, folder)
    return next(folder.glob("*.whl"))


def install_wheel(venv_python: str, wheel: Path) -> None:
    marker = Path(venv_python).resolve().parent.parent / ".quantyard-llama-cpp-wheel"
    if marker.exists() and marker.read_text() == str(wheel):
        probe = subprocess.run([venv_python, "-c", "import llama_cpp"], capture_output=True)
        if probe.returncode == 0:
            log("llama-cpp-python already installed from this wheel")
            return
    subprocess.run(
        [venv_python, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(wheel)], check=True
    )
    # its runtime deps (numpy, jinja2, diskcache, typing-extensions)
    subprocess.run([venv_python, "-m", "pip", "install", "numpy", "jinja2", "diskcache",
                    "typing-extensions"], check=True)
    marker.write_text(str(wheel))


def ensure_converter(cache: Path, sdist: Path, venv_python: str) -> Path:
    """Extract llama.cpp's converter + gguf-py from the sdist into the cache."""
    dest = cache / "llama.cpp" / VERSION
    if (dest / "toolchain.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        stage = Path(tmp) / "stage"
        changelog = ""
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                if member.name == f"llama_cpp_python-{VERSION}/CHANGELOG.md":
                    changelog = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
                if not member.name.startswith(prefix):
                    continue
                rel = member.name[len(prefix):]
                if not rel.startswith(wanted) or not (member.isfile() or member.isdir()):
                    continue
                member.name = rel
                tar.extract(member, stage, filter="data")
        section = changelog.split(f"## [{VERSION}]", 1)[-1].split("## [", 1)[0]
        commit = re.search(r"ggml-org/llama\.cpp@([0-9a-f]{7,40})", section)
        archs = subprocess.run(
            [venv_python, "-c",
             "import json,sys; sys.path[:0]=[sys.argv[1], sys.argv[1]+'/gguf-py'];"
             "from conversion import TEXT_MODEL_MAP; print(json.dumps(sorted(TEXT_MODEL_MAP)))",
             str(stage)],
            capture_output=True, text=True, check=True,
        ).stdout
        gguf_py_version = re.search(r'^version\s*=\s*"([^"]+)"',
                                    (stage / "gguf-py" / "pyproject.toml").read_text(), re.M)
        meta = {
            "llama_cpp_python": VERSION,
            "llama_cpp_commit": commit.group(1) if commit else "unknown",
            "gguf_py": gguf_py_version.group(1) if gguf_py_version else "unknown",
            "sdist_sha256": sha256_file(sdist),
            "supported_architectures": json.loads(archs),
        }
        (stage / "toolchain.json").write_text(json.dumps(meta, indent=2))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(stage, dest)
    log(f"llama.cpp converter extracted to {dest}")
    return dest


def wheel_only() -> int:
    """``--wheel-only``: the cached wheel, built here if missing, with this interpreter's pip. Where this
    Python has no pip, say so and leave the build to the install step (exit 0: nothing is lost but the overlap)."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        log(f"{sys.executable} has no pip: the wheel will be built when the venv installs it")
        return 0
    cache = cache_root()
    ensure_wheel(cache, ensure_sdist(cache), sys.executable)
    return 0


def main() -> None:
    if sys.argv[1:] == ["--wheel-only"]:
        raise SystemExit(wheel_only())
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    venv_python = sys.argv[1]
    cache = cache_root()
    sdist = ensure_sdist(cache)
    wheel = ensure_wheel(cache, sdist, venv_python)
    install_wheel(venv_python, wheel)
    ensure_converter(cache, sdist, venv_python)


if __name__ == "__main__":
    main()
