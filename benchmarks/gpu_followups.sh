#!/usr/bin/env bash
# The GPU measurements still open in BENCHMARKS.md, in one background job on one H200 (about 20 minutes):
#   1. the fused loss's GPU tests (bf16 against float64) and the tensorized layers', on the code that
#      computes the forward's logit bounds only while they pay;
#   2. the fused loss against its peers (bench_cce), `auto` beside `auto-nobounds`, the exact chunked
#      path at both budgets;
#   3. compile time, cold and warm, three cold runs each, the variants in turn, comera's defaults
#      against Inductor on both models (the ratio's spread between runs was +-0.3).
#   bash benchmarks/gpu_followups.sh [OUT_DIR]
# Run it from a copy of the tree (cp -r . /tmp/snap), with setsid. Poll with calls that each wait several
# minutes (sleep, then read $out/progress.txt), the next call starting at once: an idle machine is given
# back after 30 s. Never `pkill -f`/`pgrep -f` a pattern that the polling command's own line contains.
# bench_cce's peers come from wheels carried in .whl/ (see BENCHMARKS.md section 1).
set -u
out=${1:-gpu_followups}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stamp() { echo "$(date +%T) $*" >> "$out/progress.txt"; }
stamp start
timeout 300 python3 -m pytest -q tests/test_gpu_cce.py tests/test_gpu.py > "$out/gpu_tests.log" 2>&1
stamp "gpu tests rc $?"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  OUT="$out" PYTHONPATH=/tmp/site:$PYTHONPATH timeout 300 python3 benchmarks/bench_cce.py --shapes gemma,llama \
    --methods torch.compile,cut-cross-entropy,liger,auto,auto-nobounds,chunked > "$out/cce.log" 2>&1
  stamp "cce rc $?"  # the rows also go to $OUT/bench_cce.json
fi
for model in llama encoder; do  # variants in turn within each repeat; JSON written after each measurement
  timeout 420 python3 benchmarks/bench_compile.py --size full --device cuda --model $model --repeat 3 \
    --variants dense-inductor,tt-comera --json "$out/compile_$model.json" > "$out/compile_$model.log" 2>&1
  stamp "compile $model rc $?"
done
touch "$out/ALL_DONE"
