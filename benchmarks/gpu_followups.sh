#!/usr/bin/env bash
# The GPU measurements still open in BENCHMARKS.md, in one background job on one H200 (about 25 minutes):
#   1. step times alone: the width sweep's btt rows after the copy kernel and the in-graph weight, with
#      the dense and TT-matrix rows of the same run; the six-encoder and 128k-head LM with and without
#      tt_merges="opaque";
#   2. compile time on the GPU (bench_compile --size full), with tt_merges="opaque";
#   3. the quality study's group next2 (14 runs side by side).
#   bash benchmarks/gpu_followups.sh [OUT_DIR]
set -u
out=${1:-gpu_followups}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
for d in 2048 4096; do
  timeout 420 python3 benchmarks/bench_e2e.py --model lm-d$d --variants dense-inductor-cg,ttm,btt,btt-r4 --steps 20 \
    --json "$out/width-d$d.json" > "$out/width-d$d.log" 2>&1 || echo "width d$d: rc $?"
done
timeout 420 python3 benchmarks/bench_e2e.py --model lm-d1024 --variants dense-inductor-cg,btt --steps 20 \
  --json "$out/width-d1024.json" > "$out/width-d1024.log" 2>&1 || echo "width d1024: rc $?"
timeout 540 python3 benchmarks/bench_e2e.py --model all --variants dense-inductor-cg,tt,tt-opaque,encoder:ttm,encoder:ttm-opaque \
  --steps 20 --json "$out/e2e.json" > "$out/e2e.log" 2>&1 || echo "e2e: rc $?"
timeout 600 python3 benchmarks/bench_compile.py --size full --device cuda --variants dense-inductor,tt-comera,tt-comera-opaque \
  --no-warm --json "$out/compile.json" > "$out/compile.log" 2>&1 || echo "compile: rc $?"
timeout 900 python3 benchmarks/quality_study.py --out-dir "$out/study" --configs next2 --steps 1900 --batch-size 32 \
  --eval-every 190 --extra=--cuda-graphs --concurrency 14 --deadline-s 840 > "$out/study.log" 2>&1 || echo "study: rc $?"
rm -f "$out"/study/*.pt
touch "$out/ALL_DONE"
