#!/usr/bin/env bash
# The quality benchmark on one GPU, as recorded in BENCHMARKS.md section 4:
#   1. the timing pass: every configuration compiles side by side, then runs its timed steps alone;
#   2. the study: every configuration of the group "benchmark" at each learning rate of its own sweep,
#      1,900 steps of 32 x 512 tokens (31.1 M tokens, under one epoch of the corpus), CUDA graphs on.
# The run recorded in BENCHMARKS.md (2026-12-01) trained the rank gates at 10x the lr, train_lm's default
# then; the default is now 1x (better by 0.19 nats for TT-matrix r32). To repeat that run exactly, set
# EXTRA="--cuda-graphs --gate-lr-scale 10".
# The benchmark at the tuned learning rates only (the group "tuned": 7 runs, no sweep; about 10 minutes
# of GPU time with its timing pass, as the 2026-12-02 follow-up's 13 side-by-side runs and 6-config
# timing pass took 7.9 and 2.3 minutes): GROUP=tuned LRS=none bash benchmarks/quality_benchmark.sh DIR.
# The width study (BENCHMARKS.md section 8: d 2048 x 8 layers, time to dense's loss; about 16 GiB a run, so
# 6 at a time): GROUP=width2048 bash benchmarks/quality_benchmark.sh DIR "" 6. On a GPU whose calls are short,
# benchmarks/width_gpu.sh runs chosen rows in the background and collects them.
# ABANDON=0.1 stops a run 10 % behind another learning rate of its row at the same step (quality_study
# --abandon), so the sweep's hopeless points give the GPU to the runs still pending.
# Then, on any machine, the tables and plots from the logs:
#   python benchmarks/quality_study.py --out-dir DIR --configs benchmark --report-only --plot-dir docs \
#       --plot-prefix quality_benchmark_
#
#   bash benchmarks/quality_benchmark.sh [OUT_DIR] [DEADLINE_S] [CONCURRENCY]
set -u
out_dir=${1:-qb}
deadline=${2:-}
concurrency=${3:-14}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
common=(--out-dir "$out_dir" --configs "${GROUP:-benchmark}" --steps 1900 --batch-size 32 --eval-every 190
        "--extra=${EXTRA:---cuda-graphs}")
python3 benchmarks/quality_study.py "${common[@]}" --timing --timing-steps 40 --deadline-s "${TIMING_DEADLINE_S:-360}" ||
    echo "timing pass: rc $?"
lrs=(--lrs grid)
[ "${LRS:-grid}" = none ] && lrs=()  # the group's own NAME@LR learning rates
python3 benchmarks/quality_study.py "${common[@]}" "${lrs[@]}" --concurrency "$concurrency" \
    ${deadline:+--deadline-s "$deadline"} ${ABANDON:+--abandon "$ABANDON"}
