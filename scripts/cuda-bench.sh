#!/usr/bin/env bash
# The CUDA checks and figures in one run of about 10 minutes (`make bench-cuda`), most wanted
# first, each under its own time limit so that one that hangs leaves the rest their time.
# Results go where bench/paths.py says (RAGBLEND_BENCH_OUT overrides); logs beside them.
#
# BASELINE=DIR (a checkout of an earlier commit, e.g. `git worktree add .baseline COMMIT`
# here, carried to the GPU machine) adds that commit's engine TTFT and served-vs-direct
# TTFT first, on the same machine, so that both commits' figures compare side by side.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
case $PY in */*) PY=$(realpath "$PY") ;; esac  # the baseline's steps run in its folder
OUT=${RAGBLEND_BENCH_OUT:-bench/results}
mkdir -p "$OUT"
declare -a summary

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name (at most ${limit} s): $*"
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUT/cuda-$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/cuda-$name.log"
    summary+=("$(printf '%-16s rc %-4s %5d s' "$name" "$rc" $((SECONDS - start)))")
}

$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" || exit 1
if [ -n "${BASELINE:-}" ]; then
    # The baseline's scripts, its code: bench/served_ttft.py is this commit's, run there.
    cp bench/served_ttft.py "$BASELINE/bench/" 2>/dev/null
    step base-ttft 90 env -C "$BASELINE" RAGBLEND_BENCH_OUT="$PWD/$OUT/baseline" \
        $PY bench/engine_ttft.py --device cuda --ratios 0.15 --repeats 3
    step base-served 90 env -C "$BASELINE" RAGBLEND_BENCH_OUT="$PWD/$OUT/baseline" \
        $PY bench/served_ttft.py --device cuda --repeats 3
fi
step engine-ttft 60 $PY bench/engine_ttft.py --device cuda --profile --ratios 0.15 0.54
step served-ttft 90 $PY bench/served_ttft.py --device cuda --repeats 3
step tests 120 $PY -m pytest -q -p no:cacheprovider tests/kvstore -k cuda tests/engine/runner/test_decode_step.py \
    tests/engine/blend/test_prompt_kv.py
step decode-flex 180 $PY research/serving_decode.py --device cuda \
    --decode-attention batched flex --cuda-graphs 64 --tag flex
step ttft-split 120 $PY bench/serving.py --device cuda --schedulers batching \
    --modes cacheblend full_prefill --rate-fractions 0.5 --overload-factors --time-limit-s 3 \
    --requests 12 --tag split
step kv-pipeline 90 $PY bench/kv_pipeline.py --device cuda
printf '%s\n' "${summary[@]}" | tee "$OUT/cuda-summary.txt"
