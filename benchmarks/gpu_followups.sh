#!/usr/bin/env bash
# The GPU measurements still open in BENCHMARKS.md, in one background job on one H200 (about 12 minutes):
#   1. compile time, cold, with the variants in turn (three repeats on the six-encoder, two on the Llama
#      model): dense Inductor, comera's defaults (one configuration per pointwise kernel in graphs with
#      tensor-train layers) and comera with Inductor's first-call timing of pointwise configurations
#      back on (tt-comera-autotune); each run records how many kernels Inductor timed and for how long;
#   2. a whole training step of both, on both models (bench_e2e.py), one variant timed at a time.
#   bash benchmarks/gpu_followups.sh [OUT_DIR]
# Run it from a copy of the tree (cp -r . /tmp/snap), with setsid. Poll with calls that each wait several
# minutes (sleep, then read $out/progress.txt), the next call starting at once: an idle machine is given
# back after 30 s. Copy $out to $OUT at the end of every call (a lease can end between calls). Never
# `pkill -f`/`pgrep -f` a pattern that the polling command's own line contains.
set -u
out=${1:-gpu_followups}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stamp() { echo "$(date +%T) $*" >> "$out/progress.txt"; }
stamp start
for spec in "encoder 3" "llama 2"; do
  set -- $spec
  timeout 420 python3 benchmarks/bench_compile.py --size full --device cuda --model $1 --repeat $2 --no-warm \
    --variants dense-inductor,tt-comera,tt-comera-autotune --json "$out/compile_$1.json" \
    > "$out/compile_$1.log" 2>&1
  stamp "compile $1 rc $?"
done
timeout 300 python3 benchmarks/bench_e2e.py --model all --variants tt,tt-autotune --json "$out/e2e.json" \
  > "$out/e2e.log" 2>&1
stamp "e2e rc $?"
touch "$out/ALL_DONE"
