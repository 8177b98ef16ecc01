#!/usr/bin/env bash
# The GPU checks still open after the 2026-12-04 changes, in one background job on one H200 (about 10 minutes):
#   1. the GPU tests (tests/test_gpu.py, tests/test_gpu_cce.py), and the Inductor pre-grad pass, the loss
#      object and the device profiles on that machine's torch: the btt blocks op now saves only what the
#      asked-for gradients read, its fakes return contiguous results, and a failing swap kernel raises;
#   2. a whole training step of the width models with btt against dense Inductor + CUDA graphs
#      (bench_e2e.py --model lm-d2048 / lm-d4096): the same GPU time and kernels per step as recorded
#      in BENCHMARKS.md section 0 (the A/B of the btt op change);
#   3. bench_cce.py with learned-like softmaxes (peaked, peaked-flat): auto against its own exact path
#      (auto-exact) and a compiled user module (backend), after the sparse path's fixed costs entered
#      the cost model.
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
timeout 420 python3 -m pytest -q tests/test_gpu.py tests/test_gpu_cce.py tests/test_inductor_pass.py tests/test_losses.py \
  tests/test_devices.py > "$out/gpu_tests.log" 2>&1
stamp "gpu tests rc $?"
for model in lm-d2048 lm-d4096; do
  timeout 240 python3 benchmarks/bench_e2e.py --model $model --steps 20 --variants dense-inductor-cg,btt \
    --json "$out/e2e_$model.json" > "$out/e2e_$model.log" 2>&1
  stamp "e2e $model rc $?"
done
timeout 420 python3 benchmarks/bench_cce.py --cases peaked,peaked-flat --shapes gemma,lm1024,tt32 \
  --methods torch.compile,auto,auto-exact,backend,chunked,graph > "$out/cce.log" 2>&1
stamp "bench_cce rc $?"
touch "$out/ALL_DONE"
