#!/usr/bin/env bash
# The GPU measurements still open in BENCHMARKS.md, in one background job on one H200 (about 12 minutes):
#   1. every GPU test (bf16 against float64), the btt layers sharing an input through the batched GEMMs
#      among them (their GPU test has not run since each output became its own tensor);
#   2. benchmarks/bench_btt.py: each width's btt layer groups, the blocks against the dense layer, alone
#      (what the planner's choice rests on);
#   3. the swap kernel alone, widened and narrow (bench_swap);
#   4. compile time of the six-encoder model, the default merges against tt_merges="opaque", cold and
#      warm, against Inductor's (the 2026-12-02 step times put the two merges within 3 % of each other).
#   bash benchmarks/gpu_followups.sh [OUT_DIR]
# Run it from a copy of the tree (cp -r . /tmp/snap), with setsid. Poll with calls that each wait several
# minutes (sleep, then read $out/progress.txt), the next call starting at once: an idle machine is given
# back after 30 s. Never `pkill -f`/`pgrep -f` a pattern that the polling command's own line contains.
set -u
out=${1:-gpu_followups}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stamp() { echo "$(date +%T) $*" >> "$out/progress.txt"; }
stamp start
timeout 300 python3 -m pytest -q tests/test_gpu.py > "$out/gpu_tests.log" 2>&1
stamp "gpu tests rc $?"
timeout 240 python3 benchmarks/bench_btt.py --json "$out/btt_layers.json" > "$out/btt_layers.log" 2>&1
stamp "btt layers rc $?"
timeout 120 python3 benchmarks/bench_swap.py --json "$out/swap.json" > "$out/swap.log" 2>&1
stamp "swap rc $?"
timeout 420 python3 benchmarks/bench_compile.py --size full --device cuda --model encoder \
  --variants dense-inductor,tt-comera,tt-comera-opaque --json "$out/compile.json" > "$out/compile.log" 2>&1
stamp "compile rc $?"
touch "$out/ALL_DONE"
