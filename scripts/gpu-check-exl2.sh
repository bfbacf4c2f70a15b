#!/usr/bin/env bash
# EXL2 section of the GPU check (see ../shared/DEVICE.md); scripts/gpu-check.sh calls it on the lent
# CUDA machine. Two modes:
#
#   bash scripts/gpu-check-exl2.sh --prepare   # here, with package registries: fill .gpu-carry/exl2
#   bash scripts/gpu-check-exl2.sh             # there, from the repo root, carrying .gpu-carry/exl2
#   bash scripts/gpu-check-exl2.sh install|compile|tests   # the same run in three steps (scripts/gpu-check.sh
#                                              # run-all compiles in the background while other checks run)
#
# --prepare downloads the pure-Python exllamav2 0.3.2 wheel and the wheels (CPython 3.12, x86-64) of
# what the GPU machine lacks, and copies the demo checkpoint (~22 MB; carry total stays < 64 MiB).
#
# The run installs the wheels into .gpu-carry/exl2/site (nothing outside the tree), times exllamav2's
# JIT compile of its CUDA extension, then runs the EXL2 GPU tests (pytest -m gpu), which:
#   1. convert the demo checkpoint with real exllamav2 (measurement once, then 3.0/4.0/6.0 bpw);
#   2. dequantize every layer with exllamav2 and with our codec and compare them bit for bit, for files
#      exllamav2 wrote and files the reference codec wrote;
#   3. load files of both origins in ExLlamaV2 and evaluate them (PPL/KLD on shared windows, TTFT,
#      decode tok/s, 8 concurrent sequences) against the CPU reference engine;
#   4. save golden fixtures (< 2 MB) into $OUT/exl2-golden, then run the CPU golden test against them.
# Logs and results go to $OUT (default ./gpu-out). Copy $OUT/exl2-golden/golden.* into
# tests/fixtures/exl2/ and commit them (tests/fixtures/exl2/README.md says how they were made).
#
# EXL2_CHECK_DRY=1 runs the plumbing without a GPU (no install, no compile): the GPU tests must then
# report SKIPPED with their reason, which is how this script is checked on CPU.
set -uo pipefail

cd "$(dirname "$0")/.."
CARRY=.gpu-carry/exl2
PY=${PYTHON:-python3}

# Pinned: exllamav2 and what it imports at run time (pandas/fastparquet for calibration parquet, PIL
# for its VLM module, rich), plus Quantyard's light dependencies the tests import (pydantic-settings,
# gguf). Versions of Quantyard's own dependencies follow requirements/core.lock.
PURE=(exllamav2==0.3.2 gguf==0.19.0 pydantic==2.14.4 pydantic-settings==2.16.3 python-dotenv==1.2.4
      typing-inspection==0.4.5 annotated-types==0.8.0 typing_extensions==4.16.0 fsspec==2026.9.0
      rich==15.0.0 pygments==2.21.0 markdown-it-py==4.3.0 mdurl==0.1.2 python-dateutil==4.0.0
      pytz==2026.6 tzdata==2026.6 six==1.17.0)
BINARY=(pydantic_core==2.50.5 pandas==3.1.1 fastparquet==2026.9.0 cramjam==2.14.0 pillow==13.0.0)

prepare() {
    rm -rf "$CARRY" && mkdir -p "$CARRY/wheels"
    "$PY" -m pip download -q --no-deps -d "$CARRY/wheels" "${PURE[@]}" || return 1
    "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.12 --abi cp312 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$CARRY/wheels" "${BINARY[@]}" || return 1
    "$PY" - "$CARRY/demo" <<'EOF' || return 1
import shutil, sys
from pipeline.config import Settings
from pipeline.demo_model import cached_demo_model
shutil.copytree(cached_demo_model(Settings().cache_dir), sys.argv[1])
EOF
    du -sh "$CARRY" "$CARRY"/*
    echo "carry: .gpu-carry (the run needs it under the repo root)"
}

step() {  # step NAME COMMAND...: run, log, and record the outcome without stopping the script
    local name=$1; shift
    echo "=== $name"
    local t0=$SECONDS
    "$@"
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/exl2-summary.txt"
    return $rc
}

install_wheels() {
    "$PY" -m pip install -q --no-deps --no-index --target "$CARRY/site" "$CARRY"/wheels/*.whl
}

jit_compile() {
    "$PY" - <<'EOF'
import time
t0 = time.perf_counter()
from exllamav2.ext import exllamav2_ext  # noqa: F401  (JIT-compiles the CUDA extension on first import)
import exllamav2
print(f"exllamav2 {exllamav2.__version__}: extension ready after {time.perf_counter() - t0:.1f} s")
EOF
}

# One pytest process per test, so each failure's traceback is written when that test ends (pytest prints them at
# the end of a session, and the device's first run cut the session at its deadline: both failures were lost).
GPU_TESTS=(tests/converters/test_exl2_gpu.py tests/evaluators/test_exl2_gpu.py)

gpu_tests() {
    local ids rc=0 id
    ids=$("$PY" -m pytest -m gpu "${GPU_TESTS[@]}" --collect-only -q -p no:cacheprovider 2>/dev/null | grep '::')
    [ -n "$ids" ] || ids=$(printf '%s\n' "${GPU_TESTS[@]}")  # collection failed: run the files, to see why
    : > "$OUT/exl2-pytest.log"
    while read -r id; do
        "$PY" -m pytest -m gpu "$id" -v -s -rA --tb=long -p no:cacheprovider 2>&1 | tee -a "$OUT/exl2-pytest.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    done <<< "$ids"
    return $rc
}

golden_cpu_test() {
    [ -f "$OUT/exl2-golden/golden.safetensors" ] || { echo "no golden fixtures were written"; return 1; }
    cp "$OUT"/exl2-golden/golden.safetensors "$OUT"/exl2-golden/golden.json tests/fixtures/exl2/
    ls -l tests/fixtures/exl2/
    "$PY" -m pytest tests/converters/test_exl2_golden.py -v -rs -p no:cacheprovider
}

out_setup() {  # $OUT and its summary file; $1 = new: start the summary afresh
    OUT=${OUT:-$PWD/gpu-out}
    mkdir -p "$OUT"
    if [ "${1:-}" = new ]; then : > "$OUT/exl2-summary.txt"; else touch "$OUT/exl2-summary.txt"; fi
}

env_setup() {  # what every step after the install needs, the same in each call (subcommands below)
    out_setup
    # The cache (conversions, measurements) and the compiled extension stay in the ignored carry folder, which a
    # warm device keeps between calls; only logs, results and the golden fixtures go to $OUT (they come back).
    export QUANTYARD_CACHE_DIR="$PWD/$CARRY-cache" QUANTYARD_THREADS="$(nproc)"
    export PYTHONPATH="$PWD/$CARRY/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    NVCC=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
    export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c \
        "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))")}
    export MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_EXTENSIONS_DIR="$PWD/$CARRY-torch-extensions"
    export QUANTYARD_EXL2_PYTHON
    QUANTYARD_EXL2_PYTHON=$(command -v "$PY")
    export QUANTYARD_DEMO_CHECKPOINT="$PWD/$CARRY/demo" QUANTYARD_GOLDEN_OUT="$OUT/exl2-golden"
}

dry_run() {
    out_setup new
    echo "dry run: no GPU steps; the GPU tests must be skipped with their reason"
    unset QUANTYARD_EXL2_PYTHON QUANTYARD_CACHE_DIR
    step gpu-tests gpu_tests
    grep -q "SKIPPED" "$OUT/exl2-pytest.log" && ! grep -qE "PASSED|FAILED" "$OUT/exl2-pytest.log"
    step dry-run-skips-only test $? = 0
    cat "$OUT/exl2-summary.txt"
}

install_step() {  # the carried wheels into $CARRY/site, and what the machine has
    out_setup new
    nvidia-smi | tee "$OUT/exl2-nvidia-smi.txt"
    "$PY" -c "import torch, transformers, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name(0))"
    [ -d "$CARRY/wheels" ] && [ -d "$CARRY/demo" ] || { echo "missing $CARRY: run --prepare and carry .gpu-carry"; exit 2; }
    step install install_wheels
}

compile_step() { env_setup; step jit-compile jit_compile; }

tests_step() {  # after compile_step (the extension is then imported, not built)
    env_setup
    step gpu-tests gpu_tests
    step golden-cpu-test golden_cpu_test
    cat "$OUT/exl2-summary.txt"
    ! grep -q "rc=[1-9]" "$OUT/exl2-summary.txt"
}

run() {
    if [ "${EXL2_CHECK_DRY:-0}" = 1 ]; then dry_run; return; fi
    install_step || exit 1
    compile_step || { cat "$OUT/exl2-summary.txt"; exit 1; }
    tests_step
}

case "${1:-}" in
    --prepare) prepare ;;
    "") OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"; exec > >(tee "$OUT/exl2-check.log") 2>&1; run ;;
    install) install_step ;;
    compile) compile_step ;;
    tests) tests_step ;;
    *) echo "usage: $0 [--prepare | install | compile | tests]"; exit 2 ;;
esac
