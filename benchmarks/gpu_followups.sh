#!/usr/bin/env bash
# The GPU measurements still open in BENCHMARKS.md, in one background job on one H200 (about 15 minutes):
#   1. compile time, cold, three runs each with the variants in turn, comera's defaults against Inductor
#      and against Inductor with CUDA graphs (mode="reduce-overhead", which the backend's CUDA graphs
#      for tensor-train graphs correspond to), on both models;
#   2. one profiled cold compile of `tt` and of dense Inductor with CUDA graphs on the six-encoder, with
#      the raw profiles and the callers of the functions where the tensorized graph's extra time went
#      (Inductor's first-call benchmarking of kernel configurations, CUDA graphs, partitioning).
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
for model in encoder llama; do
  timeout 480 python3 benchmarks/bench_compile.py --size full --device cuda --model $model --repeat 3 --no-warm \
    --variants dense-inductor,dense-inductor-cg,tt-comera --json "$out/compile_$model.json" \
    > "$out/compile_$model.log" 2>&1
  stamp "compile $model rc $?"
done
mkdir -p "$out/pstats"
BENCH_COMPILE_PSTATS="$out/pstats" timeout 300 python3 benchmarks/bench_compile.py --size full --device cuda \
  --model encoder --repeat 1 --no-warm --profile --variants dense-inductor-cg,tt-comera \
  --json "$out/compile_profile.json" > "$out/compile_profile.log" 2>&1
stamp "profile rc $?"
python3 - "$out/pstats" > "$out/callers.log" 2>&1 <<'PY'
import pstats, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.pstats")):
    print("=====", f.name)
    st = pstats.Stats(str(f))
    st.sort_stats("cumulative")
    for name in ("benchmark_all_configs", "cudagraph", "min_cut_rematerialization_partition", "library.py:.*\\(wrap\\)",
                 "library.py:.*\\(define\\)"):
        st.print_callers(name, 12)
    st.print_callees("benchmark_all_configs")
PY
stamp "callers rc $?"
touch "$out/ALL_DONE"
