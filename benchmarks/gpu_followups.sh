#!/usr/bin/env bash
# The GPU measurements still open in BENCHMARKS.md, in one background job on one H200 (about 12 minutes):
#   1. compile time, cold and warm, comera against Inductor: the Llama-style LM with opaque merges, with
#      and without the fused loss's kernel precompile, and the six-encoder model with opaque merges;
#   2. the training step of both models with the default and the opaque merges (step time, kernels);
#   3. every GPU test (bf16 against float64).
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
timeout 330 python3 benchmarks/bench_compile.py --size full --device cuda --model llama \
  --variants dense-inductor,tt-comera-opaque,tt-comera-opaque-noprecompile --json "$out/compile_llama.json" \
  > "$out/compile_llama.log" 2>&1
stamp "compile llama rc $?"
timeout 200 python3 benchmarks/bench_compile.py --size full --device cuda --model encoder \
  --variants dense-inductor,tt-comera-opaque --json "$out/compile_encoder.json" > "$out/compile_encoder.log" 2>&1
stamp "compile encoder rc $?"
timeout 240 python3 benchmarks/bench_e2e.py --model all --steps 20 \
  --variants dense-inductor-cg,tt,tt-opaque,encoder:ttm,encoder:ttm-opaque --json "$out/e2e.json" > "$out/e2e.log" 2>&1
stamp "e2e rc $?"
timeout 300 python3 -m pytest -q tests/test_gpu.py tests/test_gpu_cce.py > "$out/gpu_tests.log" 2>&1
stamp "gpu tests rc $?"
touch "$out/ALL_DONE"
