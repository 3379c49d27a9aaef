#!/usr/bin/env bash
# On the GPU machine, in one call of at most 10 minutes: builds diffract-train against the
# installed PyTorch's LibTorch (preset gpu, no Qt) and trains on cuda:0.
#   Carried in .carry/ (scripts/prepare_carry.sh): CLI11 headers, emoji/ (diffract-dataset's
#   atlas) and shared/data/taesd (TAEF2; without it, the shipped model's vae/ is read). The CLIP
#   vocabulary comes from resources/clip. The shipped models do not fit the 64 MiB beside the
#   atlas: `scripts/device_tree.sh hide` before the calls, `show` after.
# PHASE=train (default): the text-to-image model, leaving in $OUT gpu.txt, train.log, loss.csv,
#   summary.json and the exported diffusers folder as diffract-emoji.tar.part-aa.. (15 MiB pieces;
#   cat, then tar -x; EXPORT=0: none). TRAIN_MINUTES (default 7; cut so that the whole call stays
#   under 9.5 minutes), TRAIN_BATCH (default 1024), TRAIN_LR (default 6e-4). Two calls on the same
#   warm machine: RESUME=1 on the second continues from the checkpoint in build/gpu-train/ (kept
#   between calls, too large to come back); give both calls the same TRAIN_SCHEDULE_MINUTES (the
#   cosine LR's length over both, e.g. 14).
# PHASE=finetune (a third call on the same machine, after PHASE=train exported build/gpu-train/model):
#   the inpainting model (INPAINT_MINUTES, default 3) and the outline-style LoRA (LORA_MINUTES,
#   default 1.5, rank LORA_RANK 16) from it, leaving in $OUT finetune.log, the two loss logs,
#   lora.safetensors and the inpainting model's unet/ and model_index.json as
#   diffract-emoji-inpaint.tar.part-aa.. (the rest of its folder is the base's).
set -euo pipefail
start=$(date +%s)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-/tmp/gpu_train}"
mkdir -p "$out"
for f in .carry/include/CLI/CLI.hpp .carry/emoji/atlas.json; do
  [[ -f "$f" ]] || { echo "missing $f: run scripts/prepare_carry.sh here and pass .carry in the carry list" >&2; exit 1; }
done
taesd=.carry/shared/data/taesd
[[ -f "$taesd/taef2_encoder.pth" ]] || taesd=resources/models/diffract-emoji/vae
[[ -e "$taesd" ]] || { echo "no TAEF2: carry .carry/shared/data/taesd (scripts/prepare_carry.sh)" >&2; exit 1; }
source scripts/gpu_common.sh
gpu_info "$out/gpu.txt"
gpu_build /tmp/gpu_train_logs diffract-train || exit 1  # logs stay on the machine: at most 8 files come back
echo "built in $(( $(date +%s) - start )) s"
common=(--device cuda:0 --atlas .carry/emoji --holdout resources/training/holdout.tsv
        --taesd "$taesd" --bpe resources/clip/bpe_simple_vocab_16e6.txt.gz --log-every 50)
run=build/gpu-train

if [[ "${PHASE:-train}" == finetune ]]; then
  [[ -f "$run/model/model_index.json" ]] || { echo "no $run/model: run PHASE=train with export first, on this machine" >&2; exit 1; }
  rm -rf build/gpu-inpaint build/gpu-lora
  build/gpu/app/diffract-train train "${common[@]}" --base "$run/model" --inpaint --out build/gpu-inpaint \
    --minutes "${INPAINT_MINUTES:-3}" --batch "${TRAIN_BATCH:-1024}" --lr "${INPAINT_LR:-3e-4}" --warmup 100 2>&1 | tee "$out/finetune.log"
  build/gpu/app/diffract-train train "${common[@]}" --base "$run/model" --lora-rank "${LORA_RANK:-16}" --style outline \
    --out build/gpu-lora --minutes "${LORA_MINUTES:-1.5}" --batch "${TRAIN_BATCH:-1024}" --lr "${LORA_LR:-1e-3}" --warmup 50 \
    2>&1 | tee -a "$out/finetune.log"
  cp build/gpu-inpaint/loss.csv "$out/inpaint-loss.csv"
  cp build/gpu-lora/loss.csv "$out/lora-loss.csv"
  cp build/gpu-lora/lora.safetensors "$out/"
  tar -C build/gpu-inpaint/model -cf - unet model_index.json | split -b 15M - "$out/diffract-emoji-inpaint.tar.part-"
  ls -la "$out"
  echo "done in $(( $(date +%s) - start )) s"
  exit 0
fi

minutes="${TRAIN_MINUTES:-7}"
left=$(python3 -c "print(max(0.5, (570 - ($(date +%s) - $start) - 45) / 60))")  # 45 s: data, stats, export, tar
minutes=$(python3 -c "print(min($minutes, $left))")
schedule="${TRAIN_SCHEDULE_MINUTES:-$minutes}"
resume=()
if [[ "${RESUME:-0}" == 1 ]]; then resume=(--resume); else rm -rf "$run"; fi
export_flag=()
[[ "${EXPORT:-1}" == 1 ]] || export_flag=(--no-export)
echo "training for $minutes minutes (LR schedule over $schedule)"
build/gpu/app/diffract-train train "${common[@]}" --out "$run" --minutes "$minutes" --schedule-minutes "$schedule" \
  --batch "${TRAIN_BATCH:-1024}" --lr "${TRAIN_LR:-6e-4}" "${resume[@]}" "${export_flag[@]}" 2>&1 | tee "$out/train.log"
cp "$run/loss.csv" "$run/summary.json" "$out/"
[[ "${EXPORT:-1}" == 1 ]] && tar -C "$run" -cf - model | split -b 15M - "$out/diffract-emoji.tar.part-"
ls -la "$out"
echo "done in $(( $(date +%s) - start )) s"
