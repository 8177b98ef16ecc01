#!/usr/bin/env bash
# One GPU, torchtitan's trainer (FSDP2 at world size 1), the d 2048 Llama-3-style model of comera_configs.py,
# three variants (dense / fused loss / TT converter + fused loss), STEPS steps each, synthetic data, offline.
# Writes $OUT/<variant>.log and $OUT/summary.json (tokens/s, peak memory, loss curve) and $OUT/loss.png.
# Needs: pip install torchtitan==0.3.0 (its deps) and comera-compile in the same environment.
set -euo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-./out}; STEPS=${STEPS:-300}; mkdir -p "$OUT"
for variant in dense fused comera; do
  torchrun --nproc_per_node 1 --master_port $((29600 + RANDOM % 100)) launch.py \
    --module comera_configs --config "llama3_2048_${variant}" \
    --training.steps "$STEPS" --dump_folder "$OUT/dump_${variant}" 2>&1 | tee "$OUT/${variant}.log" || true
done
python summarize.py "$OUT" dense fused comera
