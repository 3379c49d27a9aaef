#!/usr/bin/env python3
"""Reference oracle for SD3's MMDiT: tiny seeded diffusers SD3Transformer2DModels and their outputs.

Writes into --out only: one diffusers `transformer/` folder per config (config.json +
diffusion_pytorch_model.safetensors, random weights) and sd3_cases.safetensors with, per case,
the inputs, every intermediate the C++ side can reach (embeddings, each block's two streams)
and the output. CPU, fp32, a few seconds.
"""
import argparse
import json
import os

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from safetensors.torch import save_file

torch.set_grad_enabled(False)

BASE = dict(sample_size=8, patch_size=2, in_channels=4, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=12, caption_projection_dim=16, pooled_projection_dim=10, out_channels=5)
CONFIGS = {
    # SD3 medium's layout: no qk norm, no dual attention, last block context_pre_only.
    "sd3": dict(BASE, num_layers=3, pos_embed_max_size=8),
    # SD3.5 medium's: rms qk norm, dual attention in the first blocks, a larger position grid.
    "sd35m": dict(BASE, num_layers=3, pos_embed_max_size=12, qk_norm="rms_norm", dual_attention_layers=[0, 1]),
    # SD3.5 large's: rms qk norm only; three heads of 4.
    "sd35l": dict(BASE, num_layers=2, attention_head_dim=4, num_attention_heads=3, caption_projection_dim=12,
                  pos_embed_max_size=6, qk_norm="rms_norm", in_channels=3, out_channels=3),
}
# (batch, latent height, latent width, text tokens, timesteps)
INPUTS = {
    "3x5": (2, 6, 10, 7, [999.0, 423.5]),   # odd-ish, non-square patch grid
    "1x2": (1, 2, 4, 3, [1.0]),             # two patches
    "4x3": (2, 8, 6, 5, [500.0, 28.25]),
}


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if name.endswith("norm_q.weight") or name.endswith("norm_k.weight") or "norm_added" in name:
            p.copy_(1 + 0.2 * noise)  # norm scales around 1
        else:
            p.copy_(0.15 * noise)


def run(model, tensors, key, inputs, seed):
    b, h, w, s, ts = inputs
    c = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, c.in_channels, h, w, generator=g)
    ctx = torch.randn(b, s, c.joint_attention_dim, generator=g)
    pooled = torch.randn(b, c.pooled_projection_dim, generator=g)
    t = torch.tensor(ts, dtype=torch.float32)

    seen = {}
    hooks = [model.pos_embed.register_forward_hook(lambda m, i, o: seen.__setitem__("embed.x", o)),
             model.time_text_embed.register_forward_hook(lambda m, i, o: seen.__setitem__("embed.temb", o)),
             model.context_embedder.register_forward_hook(lambda m, i, o: seen.__setitem__("embed.context", o))]
    for n, block in enumerate(model.transformer_blocks):
        def hook(m, i, o, n=n):
            context, hidden = o
            seen[f"block{n}.x"] = hidden
            if context is not None:
                seen[f"block{n}.context"] = context
        hooks.append(block.register_forward_hook(hook))
    out = model(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t).sample
    for hk in hooks:
        hk.remove()

    tensors.update({f"{key}.in.x": x, f"{key}.in.context": ctx, f"{key}.in.pooled": pooled, f"{key}.in.t": t,
                    f"{key}.out": out})
    tensors.update({f"{key}.{k}": v.contiguous() for k, v in seen.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tensors, index = {}, {"configs": {}, "cases": []}
    seed = 300
    for name, cfg in CONFIGS.items():
        torch.manual_seed(seed)
        model = SD3Transformer2DModel(**cfg).eval()
        randomize(model, seed + 1)
        model.save_pretrained(os.path.join(args.out, name, "transformer"), safe_serialization=True)
        # A pipeline folder around it (the denoiser and its scheduler only; no VAE, no text encoders yet).
        FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(os.path.join(args.out, name, "scheduler"))
        with open(os.path.join(args.out, name, "model_index.json"), "w", encoding="utf-8") as f:
            json.dump({"_class_name": "StableDiffusion3Pipeline", "_diffusers_version": "0.42.1",
                       "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                       "transformer": ["diffusers", "SD3Transformer2DModel"]}, f, indent=1)
        index["configs"][name] = {**cfg, "num_blocks": len(model.transformer_blocks)}
        for input_name, inputs in INPUTS.items():
            seed += 10
            key = f"{name}.{input_name}"
            run(model, tensors, key, inputs, seed)
            index["cases"].append({"key": key, "config": name})
    save_file(tensors, os.path.join(args.out, "sd3_cases.safetensors"))
    with open(os.path.join(args.out, "index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)


if __name__ == "__main__":
    main()
