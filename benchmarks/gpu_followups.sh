#!/usr/bin/env bash
# The GPU measurements still open in BENCHMARKS.md, in one background job on one H200 (about 15 minutes):
#   1. the GPU tests of the btt kernels (bf16 against float64): the fused two-core kernels among them;
#   2. benchmarks/bench_btt.py: each width's btt layers, forward + backward, the fused kernels against
#      the batched GEMMs and the dense layer, and a sweep of the kernels' tile sizes;
#   3. the width sweep's btt rows with the fused kernels (the planner's mix, every site pinned to the
#      blocks, and the batched GEMMs as before), dense inductor + CUDA graphs in the same run.
#   bash benchmarks/gpu_followups.sh [OUT_DIR]
# Run it from a copy of the tree (cp -r . /tmp/snap), with setsid, and poll: see BENCHMARKS.md section 0.
set -u
out=${1:-gpu_followups}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stamp() { echo "$(date +%T) $*" >> "$out/progress.txt"; }
stamp start
timeout 300 python3 -m pytest -q tests/test_gpu.py -k "btt or ttm or lowrank" > "$out/gpu_tests.log" 2>&1
stamp "gpu tests rc $?"
timeout 420 python3 benchmarks/bench_btt.py --tiles --json "$out/btt_layers.json" > "$out/btt_layers.log" 2>&1
stamp "btt layers rc $?"
timeout 300 python3 benchmarks/bench_e2e.py --model lm-d2048 --steps 20 \
  --variants dense-inductor-cg,btt,btt-blocks,btt-gemms --json "$out/width-d2048.json" > "$out/width-d2048.log" 2>&1
stamp "width d2048 rc $?"
timeout 300 python3 benchmarks/bench_e2e.py --model lm-d4096 --steps 20 --variants dense-inductor-cg,btt,btt-gemms \
  --json "$out/width-d4096.json" > "$out/width-d4096.log" 2>&1
stamp "width d4096 rc $?"
timeout 300 python3 benchmarks/bench_e2e.py --model lm-d1024 --steps 20 --variants dense-inductor-cg,btt-blocks \
  --json "$out/width-d1024.json" > "$out/width-d1024.log" 2>&1
stamp "width d1024 rc $?"
touch "$out/ALL_DONE"
