#!/usr/bin/env python3
"""Reference oracle for the SD3 pipeline: tiny seeded diffusers StableDiffusion3Pipelines without and with T5.

Writes into --out only: `tiny-sd3/` (a pipeline folder: tiny SD3Transformer2DModel, tiny CLIP-L and
OpenCLIP-bigG-style CLIPTextModelWithProjection encoders with the fixtures' tokenizers, a tiny
16-channel AutoencoderKL with scaling and shift and no quant convs, FlowMatchEulerDiscreteScheduler
with shift 3, text_encoder_3 / tokenizer_3 null), sd3_pipeline_cases.json and
sd3_pipeline_cases.safetensors with, per case, what encode_prompt gives (T5 part zeros), the
initial latents handed to the pipeline, the final latents and the decoded image. `tiny-sd3-t5/` is the
same pipeline plus a tiny seeded T5EncoderModel (text_encoder_3, d_model = joint_attention_dim) and
make_t5_fixtures.py's SentencePiece tokenizer (tokenizer_3); its cases are keyed "t5.<case>.*". Needs
make_fixtures.py's tokenizer_l / tokenizer_g and make_t5_fixtures.py's t5/tokenizer (--fixtures).
CPU, fp32, a few seconds.
"""
import argparse
import json
import os
import shutil

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

torch.set_grad_enabled(False)


def clip(hidden, projection, act, eos, seed):
    torch.manual_seed(seed)
    cfg = CLIPTextConfig(vocab_size=49408, hidden_size=hidden, intermediate_size=2 * hidden + 3, num_hidden_layers=3,
                         num_attention_heads=4, max_position_embeddings=77, hidden_act=act, projection_dim=projection,
                         bos_token_id=49406, eos_token_id=eos, pad_token_id=1, layer_norm_eps=1e-5)
    return CLIPTextModelWithProjection(cfg).eval()


def make_pipeline(fixtures):
    tok_l = CLIPTokenizer.from_pretrained(os.path.join(fixtures, "tokenizer_l"))
    tok_g = CLIPTokenizer.from_pretrained(os.path.join(fixtures, "tokenizer_g"))
    enc_l = clip(32, 32, "quick_gelu", 2, 40)      # CLIP-L: legacy EOS (argmax)
    enc_g = clip(40, 24, "gelu", 49407, 41)        # bigG: pooled at the first EOS id
    torch.manual_seed(42)
    # joint_attention_dim 96 > 32 + 40: the CLIP features are zero-padded on channels, as SD3's
    # 768 + 1280 are to T5's 4096; pooled 32 + 24.
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=16, num_layers=2,
                                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=96,
                                        caption_projection_dim=32, pooled_projection_dim=56, out_channels=16,
                                        pos_embed_max_size=16).eval()
    g = torch.Generator().manual_seed(43)
    for p in transformer.parameters():  # diffusers' init leaves the output near zero
        p.copy_(0.1 * torch.randn(p.shape, generator=g))
    torch.manual_seed(44)
    vae = AutoencoderKL(block_out_channels=[16, 32], in_channels=3, out_channels=3, latent_channels=16,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        norm_num_groups=8, sample_size=32, scaling_factor=1.5305, shift_factor=0.0609,
                        use_quant_conv=False, use_post_quant_conv=False).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=enc_l,
                                    tokenizer=tok_l, text_encoder_2=enc_g, tokenizer_2=tok_g, text_encoder_3=None,
                                    tokenizer_3=None)


def with_t5(pipe, fixtures):
    tok = T5Tokenizer.from_pretrained(os.path.join(fixtures, "t5", "tokenizer"))
    torch.manual_seed(45)
    cfg = T5Config(vocab_size=len(tok), d_model=96, d_kv=8, d_ff=101, num_layers=2, num_heads=4,
                   feed_forward_proj="gated-gelu", dropout_rate=0.0)
    t5 = T5EncoderModel(cfg).eval()
    components = dict(pipe.components, text_encoder_3=t5, tokenizer_3=tok)
    return StableDiffusion3Pipeline(**components)


CASES = [
    dict(name="cfg", prompt="a red apple on a white background", negative_prompt="", num_inference_steps=4,
         guidance_scale=5.0, height=32, width=48, seed=7),
    dict(name="negative.batch2", prompt="a glass bottle of perfume", negative_prompt="blurry, dark",
         num_inference_steps=3, guidance_scale=4.5, height=48, width=32, seed=8, num_images_per_prompt=2),
    dict(name="nocfg", prompt="a cat", negative_prompt="", num_inference_steps=3, guidance_scale=1.0, height=32,
         width=32, seed=9),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures", required=True, help="make_fixtures.py's output (tokenizer_l, tokenizer_g)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pipe = make_pipeline(args.fixtures)
    pipe.save_pretrained(os.path.join(args.out, "tiny-sd3"))
    pipe_t5 = with_t5(pipe, args.fixtures)
    pipe_t5.save_pretrained(os.path.join(args.out, "tiny-sd3-t5"))
    # transformers 5 saves only tokenizer.json; SD3's published folders carry spiece.model too.
    shutil.copy(os.path.join(args.fixtures, "t5", "tokenizer", "spiece.model"),
                os.path.join(args.out, "tiny-sd3-t5", "tokenizer_3"))
    tensors = {}
    for prefix, p in [("", pipe), ("t5.", pipe_t5)]:
        tensors.update(run_cases(p, prefix))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(args.out, "sd3_pipeline_cases.safetensors"))
    with open(os.path.join(args.out, "sd3_pipeline_cases.json"), "w", encoding="utf-8") as f:
        json.dump(CASES, f, indent=1)


def run_cases(pipe, prefix):
    pipe.set_progress_bar_config(disable=True)
    tensors = {}
    for case in CASES:
        c = dict(case)
        name, seed = prefix + c.pop("name"), c.pop("seed")
        n = c.get("num_images_per_prompt", 1)
        cfg = c["guidance_scale"] > 1
        pe, npe, pp, npp = pipe.encode_prompt(prompt=c["prompt"], prompt_2=None, prompt_3=None,
                                              negative_prompt=c["negative_prompt"], do_classifier_free_guidance=cfg,
                                              num_images_per_prompt=n, max_sequence_length=256)
        shape = (n, 16, c["height"] // pipe.vae_scale_factor, c["width"] // pipe.vae_scale_factor)
        latents = torch.randn(shape, generator=torch.Generator().manual_seed(seed))  # as prepare_latents draws them
        final = pipe(latents=latents.clone(), output_type="latent", max_sequence_length=256, **c).images
        z = final / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.image_processor.postprocess(pipe.vae.decode(z).sample, output_type="pt")  # [B, 3, H, W] in [0, 1]
        tensors.update({f"{name}.prompt_embeds": pe, f"{name}.pooled": pp, f"{name}.latents.initial": latents,
                        f"{name}.latents.final": final, f"{name}.image": image})
        if cfg:
            tensors.update({f"{name}.negative_prompt_embeds": npe, f"{name}.negative_pooled": npp})
    return tensors


if __name__ == "__main__":
    main()
