#!/usr/bin/env bash
# The width study (group "width2048" of quality_study.py) on a lent GPU whose calls last at most ~10 minutes:
# `start` copies the tree to WORK and starts the job there in its own process session (it outlives the
# call; the next call lays the tree down anew), then polls; `poll` waits for the job (up to POLL_S
# seconds), prints each run's last validation loss and packs the logs into $OUT/width.tgz.
#
#   TIMING="w-dense,w-btt-r1" RUNS="w-dense@0.0003,w-btt-r1@0.0048" bash benchmarks/width_gpu.sh start
#   bash benchmarks/width_gpu.sh poll
#
# Environment: WORK (default /tmp/width), TIMING (configurations timed alone first; empty: none), RUNS
# (the study's runs, NAME@LR, in order of priority), CONCURRENCY (4), STEPS (1900 x 32 x 512 = 31.1 M
# tokens), EVAL_EVERY (95), EXTRA (more train_lm flags for every run), TIMING_DEADLINE_S (330), DEADLINE_S
# (the study's, 1050), POLL_S (540), ABANDON (e.g. 0.1: quality_study's --abandon, a run more than 10 % behind
# another lr of its row at the same step stops, from 30 % of the steps on; unset: none), GPU_TESTS (1:
# tests/test_gpu.py and tests/test_gpu_cce.py run beside the study, log gpu_tests.log; or the test files to
# run; unset: none). The long horizon (>= 100 M tokens, one epoch at most):
#   STEPS=6200 EVAL_EVERY=310 EXTRA="--max-corpus-mb 450" RUNS="w-dense@0.0003,w-btt-r1@0.0096,w-d1024@0.0006" ...
set -u
cmd=${1:-poll}
work=${WORK:-/tmp/width}
out=${OUT:-$work/out}
if [ "$cmd" = start ]; then
    rm -rf "$work" && mkdir -p "$work" && cp -r . "$work/tree"
    cat > "$work/job.sh" <<JOB
set -u
cd "$work/tree"
export PYTHONPATH=. PYTHONUNBUFFERED=1
common=(--out-dir "$work/study" --steps ${STEPS:-1900} --batch-size 32 --eval-every ${EVAL_EVERY:-95} "--extra=--cuda-graphs ${EXTRA:-}")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -n "${TIMING:-}" ]; then
    python3 benchmarks/quality_study.py "\${common[@]}" --configs "${TIMING:-}" --timing --timing-steps 40 \
        --deadline-s ${TIMING_DEADLINE_S:-330} || echo "timing pass: rc \$?"
fi
if [ -n "${GPU_TESTS:-}" ]; then  # the GPU tests beside the study (nothing they do is timed)
    tests="${GPU_TESTS:-}"; [ "\$tests" = 1 ] && tests="tests/test_gpu.py tests/test_gpu_cce.py"
    (timeout 600 python3 -m pytest -q -p no:cacheprovider \$tests > "$work/gpu_tests.log" 2>&1;
     echo "gpu tests rc \$?" >> "$work/gpu_tests.log") &
fi
python3 benchmarks/quality_study.py "\${common[@]}" --configs "${RUNS:-}" --concurrency ${CONCURRENCY:-4} \
    --deadline-s ${DEADLINE_S:-1050} ${ABANDON:+--abandon $ABANDON} || echo "study: rc \$?"
echo JOB-DONE
JOB
    setsid nohup bash "$work/job.sh" > "$work/job.log" 2>&1 < /dev/null &
    echo "started the job in $work (log: $work/job.log)"
fi
deadline=$((SECONDS + ${POLL_S:-540}))
while [ $SECONDS -lt $deadline ] && ! grep -q JOB-DONE "$work/job.log" 2>/dev/null; do sleep 10; done
mkdir -p "$out"
tail -n 25 "$work/job.log"
python3 - "$work/study" <<'PY'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
for sub in ("timing", "runs"):
    for path in sorted((root / sub).glob("*.json")):
        log = json.loads(path.read_text())
        evals, steps = log.get("evals") or [], log.get("steps") or []
        last = evals[-1] if evals else {}
        print(f"{sub:6} {path.stem:24} steps {len(steps):5}  val {last.get('val_loss', float('nan')):.4f} "
              f"at {last.get('step', '-')}  step_time {log.get('step_time_s') or 0:.4f}  "
              f"peak {(log.get('peak_memory_bytes') or 0) / 2**30:.1f} GiB  complete {bool(log.get('complete'))}")
PY
tar -czf "$out/width.tgz" -C "$work" job.log $(cd "$work" && ls -d gpu_tests.log study/runs study/timing study/logs study/results.md study/best.json study/results.json 2>/dev/null)
ls -la "$out"
