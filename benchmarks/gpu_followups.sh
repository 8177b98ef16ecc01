#!/usr/bin/env bash
# The GPU measurements still open in BENCHMARKS.md, in one background job on one H200 (about 20 minutes):
#   1. compile time, cold, three runs each with the variants in turn (dense, tt, dense, tt, ...), comera's
#      defaults against Inductor on both models, with what else ran on the machine as each run began;
#   2. a whole training step on both models (bench_e2e), dense Inductor + CUDA graphs against `tt`;
#   3. the fused loss's and the tensorized layers' GPU tests (bf16 against float64);
#   4. one profiled cold compile of each variant on the Llama model, with the raw profiles, and the
#      callers of the functions the last profile showed as large.
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
for model in llama encoder; do
  timeout 420 python3 benchmarks/bench_compile.py --size full --device cuda --model $model --repeat 3 --no-warm \
    --variants dense-inductor,tt-comera --json "$out/compile_$model.json" > "$out/compile_$model.log" 2>&1
  stamp "compile $model rc $?"
done
timeout 400 python3 benchmarks/bench_e2e.py --model all --variants dense-inductor-cg,tt --json "$out/e2e.json" \
  > "$out/e2e.log" 2>&1
stamp "e2e rc $?"
timeout 240 python3 -m pytest -q tests/test_gpu_cce.py tests/test_gpu.py > "$out/gpu_tests.log" 2>&1
stamp "gpu tests rc $?"
mkdir -p "$out/pstats"
BENCH_COMPILE_PSTATS="$out/pstats" timeout 300 python3 benchmarks/bench_compile.py --size full --device cuda \
  --model llama --repeat 1 --no-warm --profile --variants dense-inductor,tt-comera \
  --json "$out/compile_profile.json" > "$out/compile_profile.log" 2>&1
stamp "profile rc $?"
python3 - "$out/pstats" > "$out/callers.log" 2>&1 <<'PY'
import pstats, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.pstats")):
    print("=====", f.name)
    st = pstats.Stats(str(f))
    st.sort_stats("cumulative")
    for name in ("library.py:.*\\(define\\)", "library.py:.*\\(wrap\\)", "reinplace_inplaceable_ops", "benchmark_gpu",
                 "cudagraph", "fake_tensor_prop"):
        st.print_callers(name, 12)
PY
stamp "callers rc $?"
touch "$out/ALL_DONE"
