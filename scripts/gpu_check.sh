#!/usr/bin/env bash
# On the GPU machine (no Qt, no network): builds the core and diffract-cli against the
# installed PyTorch's LibTorch, makes the tiny reference models, and generates with them on
# CPU and CUDA, comparing both with diffusers on CUDA.
#   Carried in .carry/ (made by scripts/prepare_carry.sh): CLI11 headers, shared data, the diffusers wheel.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/gpu_common.sh
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
gpu_python_packages
gpu_info "$out/gpu.txt"
gpu_build "$out" diffract-cli || exit 1
cli=build/gpu/app/diffract-cli
"$cli" info

fx=/tmp/fixtures
python3 tests/reference/make_fixtures.py --out "$fx" --shared "$root/.carry/shared" > "$out/fixtures.log" 2>&1 || { tail -30 "$out/fixtures.log"; exit 1; }
for model in tiny-sd tiny-sdxl; do
  for dev in cpu cuda:0; do
    "$cli" generate --model "$fx/$model" --prompt "a red apple on a white background" --steps 8 --seed 7 \
      --width 64 --height 64 --device "$dev" --out "$out/$model-${dev%%:*}.png"
  done
done
python3 - "$fx" "$out" <<'PY'
import sys, numpy as np, torch
from PIL import Image
from diffusers import DiffusionPipeline
fx, out = sys.argv[1], sys.argv[2]
for model in ("tiny-sd", "tiny-sdxl"):
    pipe = DiffusionPipeline.from_pretrained(f"{fx}/{model}", torch_dtype=torch.bfloat16).to("cuda")
    ref = pipe("a red apple on a white background", num_inference_steps=8, height=64, width=64, guidance_scale=7.0,
               generator=torch.Generator().manual_seed(7), output_type="np").images[0]
    ref = (ref * 255).round()
    ours = {d: np.asarray(Image.open(f"{out}/{model}-{d}.png")).astype(np.float64) for d in ("cpu", "cuda")}
    print(model, "| ours cuda vs diffusers cuda (bf16): max", np.abs(ours["cuda"] - ref).max(),
          "mean", np.abs(ours["cuda"] - ref).mean().round(3),
          "| ours cuda (bf16) vs ours cpu (fp32; bf16 and fp32 seeds draw different noise): max", np.abs(ours["cuda"] - ours["cpu"]).max(),
          "mean", np.abs(ours["cuda"] - ours["cpu"]).mean().round(3))
PY
