#!/usr/bin/env bash
# The GPU measurements still open in BENCHMARKS.md, in one background job on one H200 (about 14 minutes):
#   1. the GPU tests of the kernels (bf16 against float64), the btt layers sharing an input among them;
#      the swap kernel's bandwidth against a plain copy (bench_swap: widened and narrow);
#   2. the width sweep's btt rows after comera::btt_blocks began writing each layer's output on its own
#      (commit e0409a0: the gradients of Q, K and V, and of gate and up, no longer concatenated);
#   3. tt_merges="opaque" after its op stopped copying per layer (stacked storages in, stacked outputs out):
#      its step time against the default's (six-encoder and 128k-head LM), and the Llama model's compile
#      time with it (the 2026-12-02 run stopped before it).
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
timeout 120 python3 benchmarks/bench_swap.py --json "$out/swap.json" > "$out/swap.log" 2>&1
stamp "swap rc $?"
timeout 300 python3 benchmarks/bench_e2e.py --model lm-d4096 --steps 20 --variants dense-inductor-cg,btt,btt-r4 \
  --json "$out/width-d4096.json" > "$out/width-d4096.log" 2>&1
stamp "width d4096 rc $?"
timeout 300 python3 benchmarks/bench_e2e.py --model lm-d2048 --steps 20 --variants dense-inductor-cg,btt \
  --json "$out/width-d2048.json" > "$out/width-d2048.log" 2>&1
stamp "width d2048 rc $?"
timeout 300 python3 benchmarks/bench_e2e.py --model lm-d1024 --steps 20 --variants dense-inductor-cg,btt \
  --json "$out/width-d1024.json" > "$out/width-d1024.log" 2>&1
stamp "width d1024 rc $?"
timeout 300 python3 benchmarks/bench_e2e.py --model all --steps 20 \
  --variants dense-inductor-cg,tt,tt-opaque,encoder:ttm,encoder:ttm-opaque --json "$out/e2e.json" > "$out/e2e.log" 2>&1
stamp "e2e rc $?"
timeout 420 python3 benchmarks/bench_compile.py --size full --device cuda --model llama \
  --variants dense-inductor,tt-comera-opaque --no-warm --json "$out/compile.json" > "$out/compile.log" 2>&1
stamp "compile rc $?"
rm -f "$out"/study/*.pt "$out"/study/cache/*/tokens.pt
touch "$out/ALL_DONE"
