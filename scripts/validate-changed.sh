#!/usr/bin/env bash
# Validate every quant a change adds or modifies: used by .github/workflows/validate-quants.yml
# and exercised by tests/flows/test_validate_changed.py.
#
# usage: scripts/validate-changed.sh BASE_REF [--source SRC] [--policy FILE] [--junit-dir DIR] [--registry R]
#
# Quants are *.gguf files and folders whose config.json has a quantization_config (AWQ, EXL2).
# Each quant's declared source is read from a sibling file "<quant>.source" (one line: a checkpoint
# folder or OWNER/NAME[@REVISION]), else from --source. Exit status: 0 all passed, 1 a check failed,
# 2 a quant could not be validated (bad input) — the worst one wins.
set -euo pipefail

base="${1:?usage: validate-changed.sh BASE_REF [options]}"; shift
source_default="" policy="" junit_dir="validate-reports" registry_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --source) source_default="$2"; shift 2 ;;
    --policy) policy="$2"; shift 2 ;;
    --junit-dir) junit_dir="$2"; shift 2 ;;
    --registry) registry_args=(--registry "$2"); shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
quantyard="${QUANTYARD:-quantyard}"
mkdir -p "$junit_dir"

mapfile -t changed < <(git diff --name-only --diff-filter=AM "$base"...HEAD)
declare -A targets=()
for f in "${changed[@]}"; do
  case "$f" in
    *.gguf) targets["$f"]=1 ;;
    */config.json|*.safetensors)
      dir=$(dirname "$f")
      if [[ -f "$dir/config.json" ]] && grep -q '"quantization_config"' "$dir/config.json"; then targets["$dir"]=1; fi ;;
  esac
done
if [[ ${#targets[@]} -eq 0 ]]; then echo "no quants changed since $base"; exit 0; fi

worst=0
for t in $(printf '%s\n' "${!targets[@]}" | sort); do
  src="$source_default"
  if [[ -f "$t.source" ]]; then src=$(head -n1 "$t.source"); fi
  args=("$t" --junit "$junit_dir/$(echo "$t" | tr '/' '_').xml" "${registry_args[@]}")
  if [[ -n "$src" ]]; then args+=(--source "$src"); fi
  if [[ -n "$policy" ]]; then args+=(--policy "$policy"); fi
  echo "::group::validate $t"
  set +e; "$quantyard" validate "${args[@]}"; rc=$?; set -e
  echo "::endgroup::"
  echo "validate $t -> exit $rc"
  if (( rc > worst )); then worst=$rc; fi
done
exit "$worst"
