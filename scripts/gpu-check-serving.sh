#!/usr/bin/env bash
# Serving section of the GPU check (see ../shared/DEVICE.md): the seed serving profile (512 prompt / 256
# output tokens, 1/8/32/64 concurrent users, GuideLLM closed loop) for ExLlamaV2 (EXL2) and vLLM CUDA (AWQ),
# and a tensor-parallel TP=1 vs TP=N comparison where the machine has N > 1 GPUs.
# PREPARED, NOT YET RUN: no GPU machine has been lent to this project when this was written.
#
#   bash scripts/gpu-check-serving.sh --prepare   # here: .gpu-carry/serving (GuideLLM and the ExLlamaV2 server's
#                                                  # wheels for the device's CPython 3.12; the demo checkpoint)
#   bash scripts/gpu-check-serving.sh             # there, from the repo root, after scripts/gpu-check-exl2.sh
#                                                  # has installed exllamav2 (its .gpu-carry/exl2/site)
#
# What it runs, each step logged to $OUT/serving-*.log with its outcome:
#   1. a Quantyard registry with the demo checkpoint converted to EXL2 4.0 bpw by real exllamav2;
#   2. `quantyard serve-bench demo/EXL2-4.0bpw --profile seed` (ExLlamaV2 behind evaluators/exllamav2/
#      openai_server.py, GuideLLM at 1/8/32/64 users), then `--sweep` (the open-loop Poisson knee);
#   3. where `python -c "import vllm"` works on the machine (a GPU host with the vllm 0.33 environment; the lent
#      device cannot take the vLLM wheel, 64 MiB carry limit): the demo's AWQ on vLLM CUDA, same profile;
#   4. where `nvidia-smi -L` lists N > 1 GPUs: the same variant at --tensor-parallel 1 and N (the results carry
#      ServerInfo.tensor_parallel, so the registry compares them as labelled, separate results);
#   5. `quantyard show --json` of every serving result into $OUT/serving-results.json.
# SERVING_CHECK_DRY=1 runs the plumbing on CPU: serve-bench must then fail with "unavailable here: ExLlamaV2 needs
# CUDA" and register a failed result, which is how this script is checked without a GPU.
set -uo pipefail

cd "$(dirname "$0")/.."
CARRY=.gpu-carry/serving
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"

# What the device's Python lacks, pinned by the repository's own requirement files: GuideLLM 0.8.1's environment
# (requirements/envs/guidellm.txt) and the ExLlamaV2 server's fastapi/uvicorn (requirements/envs/exl2.txt), less
# what the device already has (torch, transformers, numpy, ...; see ../shared/DEVICE.md) and pyarrow/datasets/
# pandas, which GuideLLM imports only for file datasets (synthetic prompts do not need them) and which alone
# would fill the carry.
ON_DEVICE='^(torch|transformers|numpy|tokenizers|safetensors|huggingface_hub|hf-xet|filelock|fsspec|packaging|jinja2|markupsafe|sympy|mpmath|networkx|regex|tqdm|pyyaml|typing_extensions|idna|certifi|pyarrow|datasets|pandas|multiprocess|dill|xxhash)=='

pins() {  # the pinned lines of the two requirement files, less ON_DEVICE
    { grep -hv '^#' requirements/envs/guidellm.txt; grep -hE '^(fastapi|uvicorn)==' requirements/envs/exl2.txt; } \
        | grep -v '^$' | grep -viE "$ON_DEVICE" | sort -u
}

prepare() {
    rm -rf "$CARRY" && mkdir -p "$CARRY/wheels"
    local pkg
    for pkg in $(pins); do  # a wheel for CPython 3.12 x86-64 where one exists, else the pure-Python one
        "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
            --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d "$CARRY/wheels" "$pkg" 2>/dev/null \
            || "$PY" -m pip download -q --no-deps -d "$CARRY/wheels" "$pkg" || return 1
    done
    du -sh "$CARRY"
    local size
    size=$(du -sb "$CARRY" | cut -f1)
    if [ "$size" -gt $((64 * 1024 * 1024)) ]; then echo "over the 64 MiB carry limit" >&2; return 1; fi
}

step() {  # step NAME COMMAND...: run, log, record the outcome without stopping the script
    local name=$1; shift
    local t0=$SECONDS
    "$@" > "$OUT/serving-$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc ($((SECONDS - t0)) s)" | tee -a "$OUT/serving-steps.txt"
    return $rc
}

run() {
    local site=.gpu-carry/exl2/site reg="$OUT/serving-registry" demo=.gpu-carry/exl2/demo
    local backend=exllamav2 variant=demo/EXL2-4.0bpw q=("$PY" -m pipeline.cli)
    rm -rf "$reg" "$OUT/serving-steps.txt"
    if [ "${SERVING_CHECK_DRY:-0}" = 1 ]; then  # CPU: the codec builds the variant, the server must refuse it
        backend=reference-cpu variant=demo/EXL2-4.0bpw-ref demo=$("$PY" -c 'from pipeline.config import Settings
from pipeline.demo_model import cached_demo_model; print(cached_demo_model(Settings().cache_dir))')
    else
        "$PY" -m pip install -q --no-index --no-deps --target "$CARRY/site" "$CARRY"/wheels/*.whl || return 1
        export PYTHONPATH="$CARRY/site:$site:$PWD" QUANTYARD_GUIDELLM_PYTHON="$PY" QUANTYARD_EXL2_PYTHON="$PY"
    fi
    step convert "${q[@]}" convert "$demo" --name demo --exl2 4.0 --exl2-backend "$backend" --no-eval \
        --registry "$reg"
    step exl2-seed "${q[@]}" serve-bench "$variant" --profile seed --registry "$reg" --json
    step exl2-sweep "${q[@]}" serve-bench "$variant" --profile seed --sweep --registry "$reg" --json
    if "$PY" -c "import vllm" 2>/dev/null; then
        step awq-convert "${q[@]}" convert "$demo" --name demo --awq --no-eval --registry "$reg"
        step awq-seed "${q[@]}" serve-bench demo/AWQ-W4-G128-asym --profile seed --registry "$reg" --json
    else
        echo "vllm: not importable here (the lent device cannot carry its wheel): vLLM CUDA serving not run" \
            | tee -a "$OUT/serving-steps.txt"
    fi
    local gpus
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [ "$gpus" -gt 1 ]; then
        step exl2-tp1 "${q[@]}" serve-bench "$variant" --profile seed --tensor-parallel 1 --registry "$reg"
        step exl2-tp"$gpus" "${q[@]}" serve-bench "$variant" --profile seed --tensor-parallel "$gpus" \
            --registry "$reg"
    else
        echo "tensor parallel: $gpus GPU(s) here, TP=1 vs TP=N needs at least 2: not run" | tee -a "$OUT/serving-steps.txt"
    fi
    "${q[@]}" show "$variant" --registry "$reg" --json > "$OUT/serving-results.json" 2>&1
}

case "${1:-}" in
    --prepare) prepare ;;
    "") run ;;
    *) echo "usage: $0 [--prepare]" >&2; exit 2 ;;
esac
