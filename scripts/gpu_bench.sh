#!/usr/bin/env bash
# On the GPU machine: builds the core and diffract-bench against the installed PyTorch's
# LibTorch, runs diffract-bench and the diffusers anchor in the same session, prints ratios.
#   Carried in .carry/ (made by scripts/prepare_carry.sh): CLI11 headers, the diffusers wheel, the anchor script.
#   BENCH_CONFIGS (default sdxl-1024,sdxl-768,sd15-512), BENCH_BATCHES (default 1,4), BENCH_RUNS (default 3),
#   BENCH_STRATEGIES (e.g. cfg-parallel,driffusion-aggressive:2; default none), GPU_CHECKS=1 runs `ctest -L gpu`
#   first, ANCHOR=0 skips the diffusers anchor.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/gpu_common.sh
out="${OUT:-/tmp/gpu_bench}"
mkdir -p "$out"
gpu_python_packages
gpu_info "$out/gpu.txt"
targets=(diffract-bench)
[ "${GPU_CHECKS:-0}" = 1 ] && targets+=(diffract-gpu-checks)
gpu_build "$out" "${targets[@]}" || exit 1

if [ "${GPU_CHECKS:-0}" = 1 ]; then
  # The NCCL basics first: if they fail, the other multi-GPU checks would only wait out their timeouts.
  if ctest --test-dir build/gpu -R gpu_nccl -V > "$out/gpu_checks.log" 2>&1; then
    ctest --test-dir build/gpu -L gpu -E gpu_nccl -V >> "$out/gpu_checks.log" 2>&1 || true
  else
    ctest --test-dir build/gpu -L gpu -LE multigpu -V >> "$out/gpu_checks.log" 2>&1 || true
    BENCH_STRATEGIES=""
  fi
  grep -E "  (ok|FAIL)  |skipped|tests passed|Timeout|rel-L2|capture|previews shown|rounds|error:|steps reported" "$out/gpu_checks.log" | head -80
fi

timeout "${BENCH_TIMEOUT:-900}" build/gpu/app/diffract-bench --device cuda:0 --config "${BENCH_CONFIGS:-sdxl-1024,sdxl-768,sd15-512}" \
  --batch "${BENCH_BATCHES:-1,4}" --runs "${BENCH_RUNS:-3}" ${BENCH_STRATEGIES:+--strategies "$BENCH_STRATEGIES"} \
  > "$out/diffract.json" 2> "$out/diffract.log" || { tail -20 "$out/diffract.log"; exit 1; }
if [ "${ANCHOR:-1}" = 1 ]; then
  python3 .carry/diffusers_sdxl_sd3.py > "$out/anchor.log" 2>&1 || { tail -20 "$out/anchor.log"; exit 1; }
  grep '^RESULT ' "$out/anchor.log" | sed 's/^RESULT //' > "$out/anchor.json"
else
  echo '{}' > "$out/anchor.json"
fi

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
ours = json.load(open(f"{out}/diffract.json"))
anchor = json.load(open(f"{out}/anchor.json"))
print("versions:", {k: ours[k] for k in ("diffract", "torch", "nccl")})
for r in ours["results"]:
    print(json.dumps({k: v for k, v in r.items() if k != "strategies"}))
    for s in r.get("strategies", []):
        print(f"  {r['config']} b{r['batch']} {s['strategy']}:{s['n']:<2} e2e {s['end_to_end_ms']:8.1f} ms"
              f"  speed-up e2e {s['speedup_end_to_end']:.2f}x denoise {s['speedup_denoising']:.2f}x"
              f"  PSNR {s['psnr_db']:.2f} dB SSIM {s['ssim']:.4f} latent rel-L2 {s['latents_rel_l2']:.4f}")
x = next((r for r in ours["results"] if r["config"] == "sdxl-1024" and r["batch"] == 1), None)
if x and anchor:
    e2e = x["end_to_end_ms"]["median"] / 1e3
    rows = [
        ("SDXL 1024 30 steps end to end (s)", e2e, anchor["pipe_sdxl_1024_30steps_pil_bf16vae_s"]),
        ("denoiser step batch 2 (ms)", x["denoiser_step_ms"]["mean"], anchor["unet_step_b2_ms"]),
        ("VAE decode 1024 (ms)", x["vae_decode_ms"], anchor["vae_decode_bf16_ms"]),
        ("peak VRAM (GiB)", x.get("peak_vram_gib", 0), anchor["pipe_mem_GiB"]),
    ]
    print(f"{'figure':40s} {'diffract':>10s} {'diffusers':>10s} {'ratio':>7s}")
    for name, a, b in rows:
        print(f"{name:40s} {a:10.3f} {b:10.3f} {a / b:7.3f}")
    print("preview added to denoising: %.1f%%, first image / later: %.2f" %
          (x["preview_added_to_denoising_pct"], x["first_vs_later"]))
    print("anchor extra: graph step b2 %.1f ms, compiled %s" % (anchor.get("unet_step_b2_cudagraph_ms", 0),
          anchor.get("unet_step_b2_compiled_ms", "not run")))
PY
