#!/usr/bin/env bash
# The GPU measurements still open in BENCHMARKS.md, in one background job on one H200 (about 25 minutes):
#   1. the GPU tests of the kernels (bf16 against float64);
#   2. timings alone: the fused low-rank kernel's GPU time (bench_lowrank, 5 ms spin); the width sweep's
#      btt rows after the planner's refit (d 2048: blocks for the FFN layers only), the weights of
#      same-structure btt layers formed in one batched merge (d 1024), and the rank-4 blocks that now
#      recompute their intermediate; the six-encoder and 128k-head LM with tt_merges="opaque";
#      compile time on the GPU (bench_compile --size full);
#   3. the quality study: its newer rows' step times alone (--timing, with dense, dense-iso and ttm-r32 in the
#      same run), then the group next3 (13 runs side by side: the learning rates next2 tried once).
#   bash benchmarks/gpu_followups.sh [OUT_DIR]
# Run it from a copy of the tree (cp -r . /tmp/snap), with setsid, and poll: see BENCHMARKS.md section 0.
set -u
out=${1:-gpu_followups}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stamp() { echo "$(date +%T) $*" >> "$out/progress.txt"; }
stamp start
timeout 240 python3 -m pytest -q tests/test_gpu.py > "$out/gpu_tests.log" 2>&1
stamp "gpu tests rc $?"
timeout 300 python3 benchmarks/bench_e2e.py --model lm-d2048 --steps 20 --variants dense-inductor-cg,btt,btt-blocks \
  --json "$out/width-d2048.json" > "$out/width-d2048.log" 2>&1
stamp "width d2048 rc $?"
timeout 300 python3 benchmarks/bench_e2e.py --model lm-d4096 --steps 20 --variants dense-inductor-cg,btt,btt-r4 \
  --json "$out/width-d4096.json" > "$out/width-d4096.log" 2>&1
stamp "width d4096 rc $?"
# the study rows' step times alone (with their peers), then the study itself in the same folder
timeout 300 python3 benchmarks/quality_study.py --out-dir "$out/study" --timing --timing-steps 40 \
  --configs dense,dense-iso,ttm-r32,btt-pkg-g1,ttm-c2-iso,tt-all-silu --batch-size 32 --extra=--cuda-graphs \
  > "$out/timing.log" 2>&1
stamp "study timing rc $?"
timeout 900 python3 benchmarks/quality_study.py --out-dir "$out/study" --configs next3 --steps 1900 --batch-size 32 \
  --eval-every 190 --extra=--cuda-graphs --concurrency 13 --deadline-s ${STUDY_DEADLINE:-660} > "$out/study.log" 2>&1
stamp "study rc $?"
timeout 300 python3 benchmarks/bench_e2e.py --model all --steps 20 \
  --variants dense-inductor-cg,tt,tt-opaque,encoder:ttm,encoder:ttm-opaque --json "$out/e2e.json" > "$out/e2e.log" 2>&1
stamp "e2e rc $?"
timeout 300 python3 benchmarks/bench_compile.py --size full --device cuda --variants dense-inductor,tt-comera,tt-comera-opaque \
  --no-warm --json "$out/compile.json" > "$out/compile.log" 2>&1
stamp "compile rc $?"
timeout 180 python3 benchmarks/bench_e2e.py --model lm-d1024 --steps 20 --variants dense-inductor-cg,btt \
  --json "$out/width-d1024.json" > "$out/width-d1024.log" 2>&1
stamp "width d1024 rc $?"
timeout 120 python3 benchmarks/bench_lowrank.py --json "$out/lowrank.json" > "$out/lowrank.log" 2>&1
stamp "lowrank rc $?"
rm -f "$out"/study/*.pt "$out"/study/cache/*/tokens.pt
touch "$out/ALL_DONE"
