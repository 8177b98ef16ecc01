#!/usr/bin/env bash
# The GPU checks still open after the 2026-12-04 (fourteenth session) changes, in one background job on one H200
# (about 12 minutes):
#   1. the GPU tests, with the Inductor pre-grad pass, the loss object, the device profiles and the auto format
#      (TTConfig() gives btt r1 to Linears >= 2048 wide), after the drivers took LossInputs and the merge ops typed
#      arguments;
#   2. a whole training step of the width models, dense Inductor + CUDA graphs against btt under backend="comera"
#      and btt through cc.use_with_inductor (bench_e2e.py -viainductor): the same step time within noise?
#      GPU time and kernels per step against BENCHMARKS.md section 0 (the A/B of the package's moves);
#   3. bench_cce.py's Gemma-2 / Llama-3 rows (random and peaked): the same paths as BENCHMARKS.md section 1;
#   4. the torchtitan demo (examples/torchtitan/run_demo.sh, d 2048, dense / fused loss / btt + fused loss,
#      STEPS steps each) from the wheels carried in .whl/titan (carry it: run(carry=[".whl"])).
#   [SKIP_TESTS=1] [TITAN_STEPS=200] bash benchmarks/gpu_followups.sh [OUT_DIR]
# Run it from a copy of the tree (cp -r . /tmp/snap), with setsid. Poll with calls that each wait several
# minutes (sleep, then read $out/progress.txt), the next call starting at once: an idle machine is given
# back after 30 s. Copy $out to $OUT at the end of every call (a lease can end between calls). Never
# `pkill -f`/`pgrep -f` a pattern that the polling command's own line contains.
set -u
out=$(realpath -m "${1:-gpu_followups}")
mkdir -p "$out"
root=$(pwd)
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stamp() { echo "$(date +%T) $*" >> "$out/progress.txt"; }
stamp start
if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: the tests ran elsewhere (beside a study, say)
  timeout 420 python3 -m pytest -q tests/test_gpu.py tests/test_gpu_cce.py tests/test_inductor_pass.py tests/test_losses.py \
    tests/test_devices.py tests/tensorize/test_auto_format.py > "$out/gpu_tests.log" 2>&1
  stamp "gpu tests rc $?"
fi
for model in lm-d2048 lm-d4096; do
  timeout 300 python3 benchmarks/bench_e2e.py --model $model --steps 20 --variants dense-inductor-cg,btt,btt-viainductor \
    --json "$out/e2e_$model.json" > "$out/e2e_$model.log" 2>&1
  stamp "e2e $model rc $?"
done
timeout 300 python3 benchmarks/bench_cce.py --shapes gemma,llama --cases random,peaked \
  --methods torch.compile,auto,auto-exact,backend > "$out/cce.log" 2>&1
stamp "bench_cce rc $?"
if [ -d .whl/titan ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/titan_site .whl/titan/*.whl > "$out/titan_install.log" 2>&1
  SITE=/tmp/titan_site OUT="$out/titan" DUMP=/tmp/titan_dump STEPS=${TITAN_STEPS:-200} timeout 900 bash examples/torchtitan/run_demo.sh \
    > "$out/titan.log" 2>&1
  stamp "titan rc $?"
fi
touch "$out/ALL_DONE"
