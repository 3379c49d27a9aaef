"""Where diffusers' SDXL UNet step spends its device time (GPU machine): the full-size config of
../shared/anchors/diffusers_sdxl_sd3.py with random weights, bf16, batch 2 at 1024², eager, under
torch.profiler; kernels summed by name and by the same rough families as diffract-bench's
`unet_step_variants.kernels`. Prints one JSON line starting with KERNELS."""
import json
import sys

import torch
from diffusers import UNet2DConditionModel

UNET = dict(act_fn="silu", addition_embed_type="text_time", addition_embed_type_num_heads=64, addition_time_embed_dim=256,
            attention_head_dim=[5, 10, 20], block_out_channels=[320, 640, 1280], cross_attention_dim=2048,
            down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], in_channels=4,
            layers_per_block=2, mid_block_type="UNetMidBlock2DCrossAttn", norm_eps=1e-5, norm_num_groups=32,
            out_channels=4, projection_class_embeddings_input_dim=2816, sample_size=128,
            transformer_layers_per_block=[1, 2, 10], up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
            use_linear_projection=True)


def family(name):
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention")):
        return "attention"
    if any(k in n for k in ("conv", "fprop", "dgrad", "wgrad")):
        return "convolution"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "matmul")):
        return "matmul"
    if "norm" in n:
        return "normalisation"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "elementwise and other"


def main():
    reps = 10
    dev, dt = "cuda", torch.bfloat16
    torch.backends.cudnn.benchmark = True
    unet = UNet2DConditionModel(**UNET).to(dev, dt).eval()
    x = torch.randn(2, 4, 128, 128, device=dev, dtype=dt)
    ehs = torch.randn(2, 77, 2048, device=dev, dtype=dt)
    add = {"text_embeds": torch.randn(2, 1280, device=dev, dtype=dt),
           "time_ids": torch.tensor([[1024, 1024, 0, 0, 1024, 1024]] * 2, device=dev, dtype=dt)}
    t = torch.tensor([500.0, 500.0], device=dev)
    with torch.no_grad():
        for _ in range(3):
            unet(x, t, ehs, added_cond_kwargs=add)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                unet(x, t, ehs, added_cond_kwargs=add)
            torch.cuda.synchronize()
    by_name, by_family, total, count = {}, {}, 0.0, 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
        ms = us / 1e3 / reps
        by_name[e.name] = by_name.get(e.name, 0.0) + ms
        f = family(e.name)
        by_family[f] = by_family.get(f, 0.0) + ms
        total += ms
        count += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    print("KERNELS " + json.dumps({"device_ms_per_call": total, "kernels_per_call": count // reps,
                                   "families_ms": by_family, "top_ms": [[n[:120], ms] for n, ms in top]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
