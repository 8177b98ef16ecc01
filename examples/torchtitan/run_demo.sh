#!/usr/bin/env bash
# One GPU, torchtitan's trainer (FSDP2 at world size 1), the d 2048 Llama-3-style model of comera_configs.py,
# the variants of comera_configs.py (dense_ce / dense / fused loss / TT converter + fused loss), STEPS steps each,
# synthetic data, offline.
# PROFILE=A:B profiles steps A..B-1 of each variant (launch.py --profile-steps: an op table in the log);
# PROFILE_PYTHON=1 adds the Python functions and a table by host time (launch.py --profile-python).
# Writes $OUT/<variant>.log and $OUT/summary.json (tokens/s, peak memory, loss curve) and $OUT/loss.png.
# Needs torchtitan 0.3.0 and comera-compile in the same environment. Without a registry: the pure-Python wheels
# torchtitan==0.3.0 torchdata tyro docstring_parser typeguard spmd_types==0.2.3 torch_checkpointing einops in a
# folder, `pip install --no-index --no-deps --target SITE FOLDER/*.whl`, then SITE=... (prepended to PYTHONPATH);
# datasets and tensorboard, which these configs never call, are stood in for when missing (launch.py --offline-stubs).
set -euo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-./out}; STEPS=${STEPS:-300}; mkdir -p "$OUT"
if [ -n "${SITE:-}" ]; then export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
PY=${PYTHON:-$(command -v python || command -v python3)}
export COMERA_LOG=${COMERA_LOG:-info}  # the log names what the comera passes rewrote in each compiled graph
PREFIX=${PREFIX:-llama3_2048}  # llama3_tiny with LAUNCH_FLAGS=--cpu: the CPU smoke run of this script
# dense_ce: torchtitan's plain cross-entropy (logits formed); dense: its ChunkedLossWrapper, which fails in its
# backward on torch 2.11 (inside torchtitan and torch), so it runs from torch 2.12 on
# At d 2048 the variants with torchtitan's CUDA graph of the step (its default; without it the btt step is
# bound by the host's launches); the tiny CPU model has no such variants.
if [ "$PREFIX" = llama3_2048 ]; then DEFAULT_VARIANTS="dense_ce_cg fused_cg comera_cg"; else DEFAULT_VARIANTS="dense_ce fused comera"; fi
if "$PY" -c "import sys, torch; sys.exit(tuple(int(v) for v in torch.__version__.split('.')[:2]) < (2, 12))"; then
  DEFAULT_VARIANTS="$DEFAULT_VARIANTS dense"
fi
VARIANTS=${VARIANTS:-$DEFAULT_VARIANTS}; DUMP=${DUMP:-$OUT}  # DUMP: torchtitan's dump folders (checkpoints)
for variant in $VARIANTS; do
  "$PY" -m torch.distributed.run --nproc_per_node 1 --master_port $((29600 + RANDOM % 100)) launch.py --offline-stubs --timing-lines ${PROFILE:+--profile-steps $PROFILE} ${PROFILE_PYTHON:+--profile-python} \
    ${LAUNCH_FLAGS:-} --module comera_configs --config "${PREFIX}_${variant}" \
    --training.steps "$STEPS" --dump_folder "$DUMP/dump_${variant}" 2>&1 | tee "$OUT/${variant}.log" || true
done
"$PY" summarize.py "$OUT" $VARIANTS
