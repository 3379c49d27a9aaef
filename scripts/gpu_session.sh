#!/usr/bin/env bash
# One call on a 2-GPU machine (nvidia-h200-x2) that does the session's GPU work in under 10
# minutes: builds the core tools; runs the multi-GPU checks and the strategy bench on both GPUs;
# then trains the emoji model on the second GPU while the first runs the single-GPU bench, the
# diffusers anchor and the single-GPU checks. Leaves in $OUT: logs.tar (every log and JSON) and
# the exported model as diffract-emoji.tar.part-* (join with cat, then tar -x).
#   Carried in .carry/ (scripts/prepare_carry.sh): CLI11 headers, shared data, the emoji atlas,
#   the anchor script and the diffusers wheel.
#   END_S (default 570): the second by which everything must be done; training gets what is left.
set -uo pipefail
export PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/gpu_common.sh
out="${OUT:-/tmp/gpu_session}"
logs=/tmp/gpu_session_logs
mkdir -p "$out" "$logs"
finish() {
  tar -C "$logs" -cf "$out/logs.tar" .
  ls -la "$out"
  echo "done at $(elapsed) s"
}
trap finish EXIT

gpu_python_packages
gpu_info "$logs/gpu.txt"
gpu_build "$logs" diffract-bench diffract-gpu-checks diffract-train || exit 1
echo "built at $(elapsed) s"
bench=build/gpu/app/diffract-bench

# Both GPUs: NCCL, strategies, cancel, failure; then the strategies against our one GPU.
ctest --test-dir build/gpu -L multigpu -V --timeout 45 > "$logs/checks_multigpu.log" 2>&1
grep -E "  (ok|FAIL)  |skipped|tests passed|Timeout|rel-L2|rounds|error:|steps reported" "$logs/checks_multigpu.log"
echo "multi-GPU checks done at $(elapsed) s"
timeout 150 "$bench" --device cuda:0 --config sdxl-1024 --batch 1 --runs 3 \
  --strategies cfg-parallel,driffusion-aggressive:2,driffusion:2,hybrid-cfg,step-skip:2 \
  > "$logs/bench_strategies.json" 2> "$logs/bench_strategies.log"
echo "strategy bench rc $? at $(elapsed) s"
grep -o '{"denoising_ms.*' "$logs/bench_strategies.log" | python3 -c "
import json, sys
for line in sys.stdin:
    s = json.loads(line)
    print(f\"  {s['strategy']}:{s['n']:<2} e2e {s['end_to_end_ms']:7.1f} ms  speed-up e2e {s['speedup_end_to_end']:.2f}x \"
          f\"denoise {s['speedup_denoising']:.2f}x  PSNR {s['psnr_db']:.1f} dB  SSIM {s['ssim']:.4f}  rel-L2 {s['latents_rel_l2']:.4f}\")"

# GPU 1 trains for what is left; GPU 0 runs the single-GPU work meanwhile.
minutes=$(python3 -c "print(round(max(0.5, (${END_S:-570} - $(elapsed) - 50) / 60), 2))")
echo "training for $minutes minutes on the second GPU"
(
  CUDA_VISIBLE_DEVICES=1 build/gpu/app/diffract-train train --device cuda:0 --atlas .carry/emoji \
    --holdout resources/training/holdout.tsv --shared .carry/shared --out build/gpu-train --minutes "$minutes" \
    --batch "${TRAIN_BATCH:-512}" --lr "${TRAIN_LR:-5e-4}" --log-every 50 > "$logs/train.log" 2>&1
  echo "trainer rc $?" >> "$logs/train.log"
  cp build/gpu-train/loss.csv build/gpu-train/summary.json "$logs/" 2>/dev/null
  tar -C build/gpu-train -cf - model | split -b 15M - "$out/diffract-emoji.tar.part-"
) &
trainer=$!
CUDA_VISIBLE_DEVICES=0 timeout 150 "$bench" --device cuda:0 --config sdxl-1024,sd15-512 --batch 1 --runs 3 \
  > "$logs/bench_single.json" 2> "$logs/bench_single.log"
echo "single-GPU bench rc $? at $(elapsed) s"
CUDA_VISIBLE_DEVICES=0 ctest --test-dir build/gpu -L gpu -LE multigpu -V --timeout 45 > "$logs/checks_single.log" 2>&1
grep -E "  (ok|FAIL)  |tests passed|capture|previews shown" "$logs/checks_single.log"
CUDA_VISIBLE_DEVICES=0 timeout $(( ${END_S:-570} - $(elapsed) - 20 )) python3 .carry/diffusers_sdxl_sd3.py > "$logs/anchor.log" 2>&1
echo "anchor rc $? at $(elapsed) s"
grep '^RESULT ' "$logs/anchor.log" | sed 's/^RESULT //' > "$logs/anchor.json"
wait "$trainer"
tail -5 "$logs/train.log"
python3 - "$logs" <<'PY'
import json, sys
d = sys.argv[1]
try:
    ours = json.load(open(f"{d}/bench_single.json"))
except Exception as e:
    print("no single-GPU bench JSON:", e); sys.exit(0)
try:
    anchor = json.load(open(f"{d}/anchor.json"))
except Exception:
    anchor = {}
for r in ours["results"]:
    print(json.dumps(r))
x = next((r for r in ours["results"] if r["config"] == "sdxl-1024"), None)
if x and anchor:
    rows = [("SDXL 1024 30 steps end to end (s)", x["end_to_end_ms"]["median"] / 1e3, anchor.get("pipe_sdxl_1024_30steps_pil_bf16vae_s")),
            ("denoiser step batch 2 (ms)", x["denoiser_step_ms"]["mean"], anchor.get("unet_step_b2_ms")),
            ("VAE decode 1024 (ms)", x["vae_decode_ms"], anchor.get("vae_decode_bf16_ms")),
            ("peak VRAM (GiB)", x.get("peak_vram_gib", 0), anchor.get("pipe_mem_GiB"))]
    for name, a, b in rows:
        if b: print(f"{name:40s} {a:10.3f} {b:10.3f} {a / b:7.3f}")
    print("anchor graph step b2", anchor.get("unet_step_b2_cudagraph_ms"))
PY
