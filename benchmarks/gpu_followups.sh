#!/usr/bin/env bash
# The GPU measurements still open in BENCHMARKS.md, in one background job on one H200 (about 16 minutes):
#   1. every GPU test (bf16 against float64), on the fused loss's forward logit bounds and the
#      opaque embedding merges, which no GPU run has seen;
#   2. the fused loss against its peers (bench_cce), `auto` (with the forward's bounds) beside
#      `auto-nobounds` (the previous behaviour);
#   3. a whole training step of the tensorized models with the dense one in the same mode and run;
#   4. compile time, cold and warm, twice each, comera's defaults against Inductor on both models.
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
timeout 300 python3 -m pytest -q tests/test_gpu.py tests/test_gpu_cce.py > "$out/gpu_tests.log" 2>&1
stamp "gpu tests rc $?"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  OUT="$out" PYTHONPATH=/tmp/site:$PYTHONPATH timeout 300 python3 benchmarks/bench_cce.py --shapes gemma,llama \
    > "$out/cce.log" 2>&1  # the rows also go to $OUT/bench_cce.json
  stamp "cce rc $?"
fi
timeout 240 python3 benchmarks/bench_e2e.py --model all --variants dense-inductor-cg,tt --json "$out/e2e.json" \
  > "$out/e2e.log" 2>&1
stamp "e2e rc $?"
timeout 600 python3 benchmarks/bench_compile.py --size full --device cuda --model all --repeat 2 \
  --variants dense-inductor,tt-comera --json "$out/compile.json" > "$out/compile.log" 2>&1
stamp "compile rc $?"
touch "$out/ALL_DONE"
