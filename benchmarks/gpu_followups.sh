#!/usr/bin/env bash
# The GPU checks still open, in one background job on one H200 (about 15 minutes):
#   1. the GPU tests (SKIP_TESTS=1 leaves them out, e.g. when they ran beside a study);
#   2. the A/B of the package refactor (issue 39): bench_e2e.py's width models, dense Inductor + CUDA graphs and
#      btt under backend="comera", from the tree of the commit before the refactor (BASE, a folder holding
#      `git archive <commit> comera_compile passes kernels benchmarks pyproject.toml`; carry it) and from this
#      tree, back to back: the same step times within noise, the same kernels per step?
#      This tree also runs btt through cc.use_with_inductor with CUDA graphs asked for (btt-cg-viainductor), the
#      same mode as backend="comera" (issue 40: the same step time within noise?);
#   3. bench_cce.py's Gemma-2 / Llama-3 rows (random and peaked), unless SKIP_CCE=1;
#   4. the torchtitan demo (examples/torchtitan/run_demo.sh, d 2048, dense_ce / fused loss / btt + fused loss, and
#      torchtitan's chunked dense from torch 2.12 on, TITAN_STEPS steps each) from the wheels carried in
#      .whl/titan (carry it). run_demo.sh's own settings pass through: VARIANTS="dense_ce_cg comera_cg" (the
#      variants to run, e.g. those with torchtitan's CUDA graph of the step), PROFILE_PYTHON=1 (host time by
#      Python function in the profile).
#
#   The swap kernel's tiles (bench_swap.py, unless SKIP_SWAP=1) run before the torchtitan demo. TITAN_AB runs
#   variants again under environment settings, one run_demo.sh each, into $OUT/titan_ab1, _ab2, ...:
#   TITAN_AB="COMERA_BTT_SWAP_TILE=best:comera_cg;COMERA_BTT_KEEP=8,COMERA_BTT_SWAP_TILE=best:comera_cg"
#   (entries split by ';', settings by ','; COMERA_BTT_SWAP_TILE=best: bench_swap's fastest token-tiled tile,
#   0 where none beats the kernel as it runs now).
#
#   5. then, if WIDTH_RUNS is set, the width study's runs (benchmarks/width_gpu.sh start, in its own
#      background job in WORK, default /tmp/width): RUNS=$WIDTH_RUNS, and width_gpu.sh's other settings
#      (TIMING, CONCURRENCY, DEADLINE_S, ABANDON, ...) pass through; collect with `bash
#      benchmarks/width_gpu.sh poll`. So one lease times the checks above alone, then trains.
#
#   [SKIP_TESTS=1] [SKIP_E2E=1] [SKIP_CCE=1] [BASE=.ab/base] [TITAN_STEPS=300] [TITAN_PROFILE=40:43]
#   [VARIANTS=...] [PROFILE_PYTHON=1] [SKIP_SWAP=1] [TITAN_AB="ENV=V,...:variants;..."] [WIDTH_RUNS=...]
#   bash benchmarks/gpu_followups.sh [OUT_DIR]
#
# Make BASE with: mkdir -p .ab/base && git archive a9ab1e1 comera_compile passes kernels benchmarks pyproject.toml
#   | tar -x -C .ab/base     (.ab/ is ignored by git: run(carry=[".whl", ".ab"])).
# Run it from a copy of the tree (cp -r . /tmp/snap), with setsid. Poll with calls that each wait several
# minutes (sleep, then read $out/progress.txt), the next call starting at once: an idle machine is given
# back after 30 s. Copy $out to $OUT at the end of every call (a lease can end between calls), as one tar:
# a folder of many files does not come back. Never `pkill -f`/`pgrep -f` a pattern that the polling
# command's own line contains.
set -u
out=$(realpath -m "${1:-gpu_followups}")
mkdir -p "$out"
root=$(pwd)
export PYTHONUNBUFFERED=1
stamp() { echo "$(date +%T) $*" >> "$out/progress.txt"; }
stamp start
if [ -z "${SKIP_TESTS:-}" ]; then
  PYTHONPATH=$root timeout 420 python3 -m pytest -q tests/test_gpu.py tests/test_gpu_cce.py tests/test_inductor_pass.py \
    tests/test_losses.py tests/test_devices.py tests/tensorize/test_auto_format.py tests/tensorize/test_shared_class.py \
    > "$out/gpu_tests.log" 2>&1
  stamp "gpu tests rc $?"
fi
models="lm-d2048 lm-d4096"; [ -n "${SKIP_E2E:-}" ] && models=""
for model in $models; do
  if [ -n "${BASE:-}" ] && [ -d "${BASE}/comera_compile" ]; then
    base=$(realpath "$BASE")
    (cd "$base" && PYTHONPATH=$base timeout 300 python3 benchmarks/bench_e2e.py --model $model --steps 20 \
      --variants dense-inductor-cg,btt --json "$out/e2e_base_$model.json" > "$out/e2e_base_$model.log" 2>&1)
    stamp "e2e base $model rc $?"
  fi
  PYTHONPATH=$root timeout 300 python3 benchmarks/bench_e2e.py --model $model --steps 20 \
    --variants dense-inductor-cg,btt,btt-cg-viainductor --json "$out/e2e_$model.json" > "$out/e2e_$model.log" 2>&1
  stamp "e2e $model rc $?"
done
if [ -z "${SKIP_CCE:-}" ]; then
  PYTHONPATH=$root timeout 300 python3 benchmarks/bench_cce.py --shapes gemma,llama --cases random,peaked \
    --methods torch.compile,auto,auto-exact,backend > "$out/cce.log" 2>&1
  stamp "bench_cce rc $?"
fi
if [ -z "${SKIP_SWAP:-}" ]; then
  PYTHONPATH=$root timeout 300 python3 benchmarks/bench_swap.py --json "$out/swap.json" > "$out/swap.log" 2>&1
  stamp "bench_swap rc $?"
fi
if [ -d .whl/titan ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/titan_site .whl/titan/*.whl > "$out/titan_install.log" 2>&1
  PYTHONPATH=$root SITE=/tmp/titan_site OUT="$out/titan" DUMP=/tmp/titan_dump STEPS=${TITAN_STEPS:-300} PROFILE=${TITAN_PROFILE:-40:43} timeout 900 \
    bash examples/torchtitan/run_demo.sh > "$out/titan.log" 2>&1
  stamp "titan rc $?"
  i=0
  IFS=';' read -ra ab_runs <<< "${TITAN_AB:-}"
  for spec in "${ab_runs[@]}"; do  # "NAME=VALUE,NAME=VALUE:variant variant": the variants again with that env
    [ -n "${spec// /}" ] || continue
    if [[ "$spec" != *=*:* ]]; then  # env would run a setting without '=' as a command
      stamp "TITAN_AB: '$spec' is not NAME=VALUE[,NAME=VALUE]:variants; skipped"
      continue
    fi
    i=$((i + 1))
    settings=() variants=${spec#*:}
    IFS=',' read -ra pairs <<< "${spec%%:*}"
    for pair in "${pairs[@]}"; do
      [[ "$pair" == ?*=* ]] || { stamp "TITAN_AB: '$pair' is not NAME=VALUE; left out"; continue; }
      if [ "$pair" = COMERA_BTT_SWAP_TILE=best ]; then  # bench_swap's fastest token-tiled tile (0: none beat it)
        pair=COMERA_BTT_SWAP_TILE=$(python3 benchmarks/bench_swap.py --best-tile "$out/swap.json" 2>> "$out/swap.log")
      fi
      settings+=("$pair")
    done
    echo "${settings[*]}: $variants" > "$out/titan_ab$i.txt"
    env "${settings[@]}" PYTHONPATH=$root SITE=/tmp/titan_site OUT="$out/titan_ab$i" DUMP=/tmp/titan_dump \
      VARIANTS="$variants" STEPS=${TITAN_STEPS:-300} PROFILE=${TITAN_PROFILE:-40:43} timeout 600 \
      bash examples/torchtitan/run_demo.sh > "$out/titan_ab$i.log" 2>&1
    stamp "titan A/B $i (${settings[*]}: $variants) rc $?"
  done
fi
if [ -n "${WIDTH_RUNS:-}" ]; then
  RUNS="$WIDTH_RUNS" POLL_S=0 OUT="$out/width" bash benchmarks/width_gpu.sh start \
    > "$out/width_start.log" 2>&1
  stamp "width study started (${WORK:-/tmp/width}/job.log)"
fi
touch "$out/ALL_DONE"
