#!/usr/bin/env python3
"""Reference oracle for Flux.1: tiny seeded diffusers FluxTransformer2DModels and FluxPipelines.

Writes into --out only:
- `tiny-flux-dev/` (a FluxPipeline folder: tiny FluxTransformer2DModel with the guidance
  embedding, a tiny CLIPTextModel with make_fixtures.py's CLIP-L tokenizer, a tiny seeded
  T5EncoderModel with make_t5_fixtures.py's SentencePiece tokenizer, a tiny 16-channel
  AutoencoderKL with Flux's scaling and shift and no quant convs, FlowMatchEulerDiscreteScheduler
  with Flux.1-dev's resolution-dependent shift) and `tiny-flux-schnell/` (no guidance embedding,
  schnell's static schedule);
- flux_transformer_cases.safetensors: per case the transformer's inputs, its embeddings, every
  block's streams and its output;
- flux_pipeline_cases.json / .safetensors: per case what encode_prompt gives, the initial latents
  (unpacked, [B, 16, h, w]), the final latents (unpacked) and the decoded image.
CPU, fp32, a few seconds.
"""
import argparse
import json
import os
import shutil

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

torch.set_grad_enabled(False)

DEV_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                     num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
SCHNELL_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


def transformer(guidance, seed, **overrides):
    torch.manual_seed(seed)
    cfg = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=3, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=48, pooled_projection_dim=32, guidance_embeds=guidance,
               axes_dims_rope=(4, 6, 6))
    cfg.update(overrides)
    model = FluxTransformer2DModel(**cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():  # diffusers' init leaves the output near zero
        if "norm_q" in name or "norm_k" in name or "norm_added" in name:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def make_pipeline(fixtures, guidance):
    tok = CLIPTokenizer.from_pretrained(os.path.join(fixtures, "tokenizer_l"))
    torch.manual_seed(50)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=32, intermediate_size=67, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=77, hidden_act="quick_gelu",
                                        bos_token_id=49406, eos_token_id=2, pad_token_id=1)).eval()
    tok_2 = T5TokenizerFast.from_pretrained(os.path.join(fixtures, "t5", "tokenizer"))
    torch.manual_seed(51)
    t5 = T5EncoderModel(T5Config(vocab_size=len(tok_2), d_model=48, d_kv=8, d_ff=61, num_layers=2, num_heads=4,
                                 feed_forward_proj="gated-gelu", dropout_rate=0.0)).eval()
    tr = transformer(guidance, 52 if guidance else 62)
    torch.manual_seed(54)
    vae = AutoencoderKL(block_out_channels=[16, 32], in_channels=3, out_channels=3, latent_channels=16,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        norm_num_groups=8, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
                        use_quant_conv=False, use_post_quant_conv=False).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**(DEV_SCHEDULER if guidance else SCHNELL_SCHEDULER))
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=tok, text_encoder_2=t5,
                        tokenizer_2=tok_2, transformer=tr)


# (batch, latent height, latent width in 2x2 patches, text tokens, sigma, guidance)
TRANSFORMER_CASES = {
    "dev.3x5": (True, 2, 3, 5, 7, [0.999, 0.4235], [3.5, 1.0]),
    "dev.1x1": (True, 1, 1, 1, 2, [0.5], [4.0]),
    "schnell.4x2": (False, 1, 4, 2, 6, [0.75], None),
}


def transformer_cases(tensors):
    seed = 400
    for key, (guidance, b, h, w, s, sigma, gd) in TRANSFORMER_CASES.items():
        model = transformer(guidance, seed)
        for name, p in model.state_dict().items():
            tensors[f"{key}.weights.{name}"] = p.contiguous()
        g = torch.Generator().manual_seed(seed + 5)
        c = model.config
        x = torch.randn(b, h * w, c.in_channels, generator=g)
        ctx = torch.randn(b, s, c.joint_attention_dim, generator=g)
        pooled = torch.randn(b, c.pooled_projection_dim, generator=g)
        t = torch.tensor(sigma)
        img_ids = torch.zeros(h, w, 3)
        img_ids[..., 1] += torch.arange(h)[:, None]
        img_ids[..., 2] += torch.arange(w)[None, :]
        img_ids = img_ids.reshape(h * w, 3)
        txt_ids = torch.zeros(s, 3)
        seen = {}
        hooks = [model.x_embedder.register_forward_hook(lambda m, i, o: seen.__setitem__("embed.x", o)),
                 model.time_text_embed.register_forward_hook(lambda m, i, o: seen.__setitem__("embed.temb", o)),
                 model.context_embedder.register_forward_hook(lambda m, i, o: seen.__setitem__("embed.context", o))]
        for n, block in enumerate(model.transformer_blocks):
            def hook(m, i, o, n=n):
                seen[f"double{n}.context"], seen[f"double{n}.x"] = o
            hooks.append(block.register_forward_hook(hook))
        for n, block in enumerate(model.single_transformer_blocks):
            def hook(m, i, o, n=n):
                seen[f"single{n}.context"], seen[f"single{n}.x"] = o
            hooks.append(block.register_forward_hook(hook))
        out = model(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t,
                    guidance=torch.tensor(gd) if gd else None, img_ids=img_ids, txt_ids=txt_ids).sample
        for hk in hooks:
            hk.remove()
        tensors.update({f"{key}.in.x": x, f"{key}.in.context": ctx, f"{key}.in.pooled": pooled, f"{key}.in.t": t,
                        f"{key}.in.img_ids": img_ids, f"{key}.in.txt_ids": txt_ids, f"{key}.out": out})
        if gd:
            tensors[f"{key}.in.guidance"] = torch.tensor(gd)
        cos, sin = model.pos_embed(torch.cat([txt_ids, img_ids]))
        tensors.update({f"{key}.rope.cos": cos, f"{key}.rope.sin": sin})
        tensors.update({f"{key}.{k}": v.contiguous() for k, v in seen.items()})
        seed += 10


CASES = [
    dict(name="dev", model="dev", prompt="a red apple on a white background", num_inference_steps=4,
         guidance_scale=3.5, height=32, width=48, seed=7, max_sequence_length=512),
    dict(name="dev.truecfg.batch2", model="dev", prompt="a glass bottle of perfume", negative_prompt="blurry, dark",
         true_cfg_scale=4.0, num_inference_steps=3, guidance_scale=2.0, height=48, width=32, seed=8,
         num_images_per_prompt=2, max_sequence_length=512),
    dict(name="schnell", model="schnell", prompt="a cat", num_inference_steps=2, guidance_scale=0.0, height=32,
         width=32, seed=9, max_sequence_length=256),
]


def pipeline_cases(pipes, tensors):
    for case in CASES:
        c = dict(case)
        name, seed, pipe = c.pop("name"), c.pop("seed"), pipes[c.pop("model")]
        pipe.set_progress_bar_config(disable=True)
        n = c.get("num_images_per_prompt", 1)
        pe, pooled, text_ids = pipe.encode_prompt(prompt=c["prompt"], prompt_2=None, num_images_per_prompt=n,
                                                  max_sequence_length=c["max_sequence_length"])
        tensors.update({f"{name}.prompt_embeds": pe, f"{name}.pooled": pooled})
        if "negative_prompt" in c:
            npe, npooled, _ = pipe.encode_prompt(prompt=c["negative_prompt"], prompt_2=None,
                                                 num_images_per_prompt=n, max_sequence_length=c["max_sequence_length"])
            tensors.update({f"{name}.negative_prompt_embeds": npe, f"{name}.negative_pooled": npooled})
        f = pipe.vae_scale_factor
        h, w = 2 * (c["height"] // (f * 2)), 2 * (c["width"] // (f * 2))
        latents = torch.randn((n, 16, h, w), generator=torch.Generator().manual_seed(seed))  # as prepare_latents
        packed = pipe._pack_latents(latents, n, 16, h, w)
        final = pipe(latents=packed.clone(), output_type="latent", **c).images
        final = pipe._unpack_latents(final, c["height"], c["width"], f)
        z = final / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.image_processor.postprocess(pipe.vae.decode(z).sample, output_type="pt")  # [B, 3, H, W] in [0, 1]
        tensors.update({f"{name}.latents.initial": latents, f"{name}.latents.final": final, f"{name}.image": image})


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures", required=True, help="make_fixtures.py's output (tokenizer_l) and t5/tokenizer")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tensors = {}
    transformer_cases(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(args.out, "flux_transformer_cases.safetensors"))
    pipes = {"dev": make_pipeline(args.fixtures, True), "schnell": make_pipeline(args.fixtures, False)}
    for name, pipe in pipes.items():
        folder = os.path.join(args.out, f"tiny-flux-{name}")
        pipe.save_pretrained(folder)
        # transformers 5 saves only tokenizer.json; Flux's published folders carry spiece.model too.
        shutil.copy(os.path.join(args.fixtures, "t5", "tokenizer", "spiece.model"), os.path.join(folder, "tokenizer_2"))
    tensors = {}
    pipeline_cases(pipes, tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(args.out, "flux_pipeline_cases.safetensors"))
    with open(os.path.join(args.out, "flux_pipeline_cases.json"), "w", encoding="utf-8") as f:
        json.dump(CASES, f, indent=1)


if __name__ == "__main__":
    main()
