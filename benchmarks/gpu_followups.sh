#!/usr/bin/env bash
# The GPU measurements still open in BENCHMARKS.md, in one background job on one H200 (about 24 minutes):
#   1. the GPU tests of the kernels changed since the last lease (bf16 against float64);
#   2. timings alone: the fused low-rank kernel against cuBLAS (bench_lowrank), the width sweep's btt rows
#      (the plain ops with comera::btt_swap, and comera::btt_blocks under tt_merges="opaque") with dense
#      in the same run, and the fused loss's automatic path on peaked logits (bench_cce);
#   3. the quality study's group next2 (17 runs side by side).
#   bash benchmarks/gpu_followups.sh [OUT_DIR]
set -u
out=${1:-gpu_followups}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stamp() { echo "$(date +%T) $*" >> "$out/progress.txt"; }
stamp start
timeout 300 python3 -m pytest -q tests/test_gpu.py -k "btt or ttm or lowrank" > "$out/gpu_tests.log" 2>&1
stamp "gpu tests rc $?"
if [ -f benchmarks/bench_lowrank.py ]; then
  timeout 180 python3 benchmarks/bench_lowrank.py --json "$out/lowrank.json" > "$out/lowrank.log" 2>&1
  stamp "lowrank rc $?"
  timeout 120 python3 benchmarks/bench_lowrank.py --activation silu --bias --no-compile --json "$out/lowrank-silu.json" \
    > "$out/lowrank-silu.log" 2>&1
  stamp "lowrank silu rc $?"
fi
for d in 2048 4096; do
  timeout 300 python3 benchmarks/bench_e2e.py --model lm-d$d --steps 20 \
    --variants dense-inductor-cg,ttm,btt,btt-opaque,btt-r4,btt-r4-opaque \
    --json "$out/width-d$d.json" > "$out/width-d$d.log" 2>&1
  stamp "width d$d rc $?"
done
timeout 240 python3 benchmarks/bench_e2e.py --model lm-d1024 --steps 20 --variants dense-inductor-cg,btt,btt-opaque \
  --json "$out/width-d1024.json" > "$out/width-d1024.log" 2>&1
stamp "width d1024 rc $?"
timeout 240 python3 benchmarks/bench_cce.py ${CCE_ARGS:---shapes gemma,llama --cases peaked} \
  > "$out/cce.log" 2>&1
stamp "cce rc $?"
timeout 1000 python3 benchmarks/quality_study.py --out-dir "$out/study" --configs next2 --steps 1900 --batch-size 32 \
  --eval-every 190 --extra=--cuda-graphs --concurrency 17 --deadline-s ${STUDY_DEADLINE:-870} > "$out/study.log" 2>&1
stamp "study rc $?"
rm -f "$out"/study/*.pt
touch "$out/ALL_DONE"
