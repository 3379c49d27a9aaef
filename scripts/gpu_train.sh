#!/usr/bin/env bash
# On the GPU machine, in one call of at most 10 minutes: builds diffract-train against the
# installed PyTorch's LibTorch (preset gpu, no Qt), trains the embedded emoji model on cuda:0
# and leaves in $OUT (7 files, about 40 MB): gpu.txt, train.log, loss.csv, summary.json and the
# exported diffusers folder as diffract-emoji.tar.part-aa.. (15 MiB pieces; cat, then tar -x).
#   Carried in .carry/ (scripts/prepare_carry.sh): CLI11 headers, shared/data (TAEF2 weights,
#   CLIP BPE) and emoji/ (diffract-dataset's atlas).
#   TRAIN_MINUTES (default 7; cut so that the whole call stays under 9.5 minutes), TRAIN_BATCH
#   (default 1024), TRAIN_LR (default 6e-4).
#   Two calls on the same warm machine: RESUME=1 on the second continues from the checkpoint in
#   build/gpu-train/ (kept between calls, too large to come back); give both calls the same
#   TRAIN_SCHEDULE_MINUTES (the cosine LR's length over both, e.g. 14).
set -euo pipefail
start=$(date +%s)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-/tmp/gpu_train}"
mkdir -p "$out"
for f in .carry/include/CLI/CLI.hpp .carry/shared/data/taesd/taef2_encoder.pth .carry/emoji/atlas.json; do
  [[ -f "$f" ]] || { echo "missing $f: run scripts/prepare_carry.sh here and pass .carry in the carry list" >&2; exit 1; }
done
source scripts/gpu_common.sh
gpu_info "$out/gpu.txt"
gpu_build /tmp/gpu_train_logs diffract-train || exit 1  # logs stay on the machine: at most 8 files come back
echo "built in $(( $(date +%s) - start )) s"

minutes="${TRAIN_MINUTES:-7}"
left=$(python3 -c "print(max(0.5, (570 - ($(date +%s) - $start) - 45) / 60))")  # 45 s: data, stats, export, tar
minutes=$(python3 -c "print(min($minutes, $left))")
schedule="${TRAIN_SCHEDULE_MINUTES:-$minutes}"
run=build/gpu-train
resume=()
if [[ "${RESUME:-0}" == 1 ]]; then resume=(--resume); else rm -rf "$run"; fi
echo "training for $minutes minutes (LR schedule over $schedule)"
build/gpu/app/diffract-train train --device cuda:0 --atlas .carry/emoji --holdout resources/training/holdout.tsv \
  --shared .carry/shared --out "$run" --minutes "$minutes" --schedule-minutes "$schedule" \
  --batch "${TRAIN_BATCH:-1024}" --lr "${TRAIN_LR:-6e-4}" --log-every 50 "${resume[@]}" 2>&1 | tee "$out/train.log"
cp "$run/loss.csv" "$run/summary.json" "$out/"
tar -C "$run" -cf - model | split -b 15M - "$out/diffract-emoji.tar.part-"
ls -la "$out"
echo "done in $(( $(date +%s) - start )) s"
