#!/usr/bin/env python3
"""Seed corpora for the fuzz harnesses (tests/fuzz/fuzz_*.cpp), one folder per harness under --out:
small valid inputs of every kind the parsers take, written with the libraries that write them in
the wild (safetensors, torch.save, Pillow), plus the fixture files of the reference scripts when
--fixtures is given (configs, tokenizer files, PNGs with parameters). Seconds, CPU."""
import argparse
import glob
import io
import json
import os
import shutil

import torch
from PIL import Image, PngImagePlugin
from safetensors.torch import save


def put(out, harness, name, data):
    d = os.path.join(out, harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fixtures", default="")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    dicts = {
        "small": {"w": torch.randn(2, 3, generator=g), "b": torch.zeros(3)},
        "dtypes": {"h": torch.ones(4, dtype=torch.float16), "bf": torch.ones(2, dtype=torch.bfloat16),
                   "i": torch.arange(3, dtype=torch.int64), "u": torch.ones(5, dtype=torch.uint8),
                   "s": torch.tensor(1.0), "e": torch.zeros(0, 4)},
        "unet": {"conv_in.weight": torch.randn(8, 4, 3, 3, generator=g), "time_embedding.linear_1.weight": torch.randn(16, 8, generator=g)},
    }
    for name, sd in dicts.items():
        put(args.out, "safetensors", name + ".safetensors", save(sd, metadata={"format": "pt"}))
        buf = io.BytesIO()
        torch.save(sd, buf)
        put(args.out, "pth", name + ".pth", buf.getvalue())
    buf = io.BytesIO()
    torch.save({"state_dict": dicts["small"], "epoch": 3, "name": "x", "list": [1, 2.5, None, True]}, buf)
    put(args.out, "pth", "nested.pth", buf.getvalue())

    configs = [{"_class_name": "UNet2DConditionModel", "block_out_channels": [32, 64], "layers_per_block": 2,
                "attention_head_dim": 8, "cross_attention_dim": 32, "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                "norm_eps": 1e-5, "use_linear_projection": False, "sample_size": 16},
               {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
                "vae": ["diffusers", "AutoencoderKL"]},
               {"name": "Studio", "prompt_template": "{subject}, studio", "width": 1024, "height": 1024, "steps": 30,
                "sampler": "euler", "cfg": 7.0, "loras": [{"name": "a", "weight": 0.8}]},
               # A tuning store of the identity fuzz_json checks against.
               {"format": "diffract-tuning", "version": 1, "identity": {"gpu": "NVIDIA H200", "driver": "580.159.04"},
                "tables": {"gemm": {"1024x1280x1280 BFloat16 bias align16": {
                    "cublaslt": True, "algo": ["0000000000000017"] * 8, "workspace": 0, "aten_ms": 0.02,
                    "first_ms": 0.02, "best_ms": 0.01, "tried": 9}},
                    "conv": {"2x320x128x128 -> 320 k3x3 s1 p1 BFloat16 channels-last": {
                        "plan": "heuristic", "heuristic_ms": 0.1, "benchmark_ms": 0.1}}}}]
    for i, c in enumerate(configs):
        put(args.out, "json", f"config{i}.json", json.dumps(c))

    a1111 = ("a (red:1.2) apple, [blurry]\nNegative prompt: ugly\nSteps: 20, Sampler: DPM++ 2M, Schedule type: Karras, "
             "CFG scale: 7, Seed: 42, Size: 512x768, Model hash: abc, Lora hashes: \"style: 0123456789ab\"")
    comfy = json.dumps({"3": {"class_type": "KSampler", "inputs": {"seed": 1, "steps": 20, "cfg": 7, "sampler_name": "euler",
                                                                    "scheduler": "normal", "positive": ["6", 0],
                                                                    "negative": ["7", 0], "latent_image": ["5", 0]}},
                        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 1}},
                        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "an apple"}},
                        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "ugly"}}})
    ours = json.dumps({"prompt": "an apple", "seed": 42, "steps": 20, "cfg": 7.0, "width": 512, "height": 512,
                       "sampler": "euler", "loras": [{"path": "/l/a.safetensors", "weight": 0.5}]})
    put(args.out, "png_parameters", "all", "\0".join([a1111, comfy, ours]))
    put(args.out, "png_parameters", "a1111", a1111)

    for mode, ext in (("RGB", "png"), ("RGBA", "png"), ("L", "png"), ("P", "png"), ("RGB", "jpeg")):
        im = Image.new(mode, (7, 5), 3)
        b = io.BytesIO()
        info = PngImagePlugin.PngInfo()
        info.add_text("parameters", a1111)
        im.save(b, format=ext.upper(), **({"pnginfo": info} if ext == "png" else {}))
        put(args.out, "image", f"{mode}.{ext}", b.getvalue())

    # LoRAs for fuzz_lora's small model (its modules and shapes), one file per format.
    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.float16)
    blk = "down_blocks_0_attentions_0_transformer_blocks_0_"
    loras = {
        "kohya": ({f"lora_unet_{blk}attn1_to_q.lora_down.weight": r(2, 8), f"lora_unet_{blk}attn1_to_q.lora_up.weight": r(8, 2),
                   f"lora_unet_{blk}attn1_to_q.alpha": torch.tensor(1.0),
                   f"lora_unet_{blk}attn2_to_k.lora_down.weight": r(2, 16), f"lora_unet_{blk}attn2_to_k.lora_up.weight": r(8, 2),
                   "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": r(4, 16),
                   "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": r(32, 4),
                   "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": r(2, 16),
                   "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": r(16, 2)}, None),
        "locon": ({"lora_unet_conv_in.lora_down.weight": r(2, 4, 3, 3), "lora_unet_conv_in.lora_up.weight": r(8, 2, 1, 1),
                   "lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight": r(2, 8, 3, 3),
                   "lora_unet_down_blocks_0_resnets_0_conv1.lora_mid.weight": r(2, 2, 3, 3),
                   "lora_unet_down_blocks_0_resnets_0_conv1.lora_up.weight": r(8, 2, 1, 1),
                   "lora_unet_down_blocks_0_resnets_0_conv1.alpha": torch.tensor(2.0)}, None),
        "loha": ({f"lora_unet_{blk}ff_net_2.hada_w1_a": r(8, 2), f"lora_unet_{blk}ff_net_2.hada_w1_b": r(2, 8),
                  f"lora_unet_{blk}ff_net_2.hada_w2_a": r(8, 2), f"lora_unet_{blk}ff_net_2.hada_w2_b": r(2, 8),
                  f"lora_unet_{blk}ff_net_2.alpha": torch.tensor(2.0)}, None),
        "lokr": ({f"lora_unet_{blk}ff_net_0_proj.lokr_w1": r(8, 2), f"lora_unet_{blk}ff_net_0_proj.lokr_w2_a": r(8, 2),
                  f"lora_unet_{blk}ff_net_0_proj.lokr_w2_b": r(2, 4),
                  "lora_unet_up_blocks_1_attentions_0_proj_out.lokr_w1_a": r(2, 1), "lora_unet_up_blocks_1_attentions_0_proj_out.lokr_w1_b": r(1, 2),
                  "lora_unet_up_blocks_1_attentions_0_proj_out.lokr_w2": r(4, 4)}, None),
        "peft": ({"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k.lora_A.weight": r(2, 8),
                  "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k.lora_B.weight": r(8, 2),
                  "text_encoder.text_model.encoder.layers.0.self_attn.v_proj.lora_A.default.weight": r(2, 16),
                  "text_encoder.text_model.encoder.layers.0.self_attn.v_proj.lora_B.default.weight": r(16, 2),
                  "transformer.transformer_blocks.0.attn.add_q_proj.lora_A.weight": r(2, 8),
                  "transformer.transformer_blocks.0.attn.add_q_proj.lora_B.weight": r(8, 2)},
                 {"lora_adapter_metadata": json.dumps({"r": 2, "lora_alpha": 4, "alpha_pattern": {"to_k": 2}})}),
    }
    for name, (sd, meta) in loras.items():
        put(args.out, "lora", name + ".safetensors", save(sd, metadata=meta))

    for i, p in enumerate(["a (red:1.2) apple, ((shiny)) [blurry] BREAK on a table <lora:style:0.8>",
                           "\\(literal\\) (a:1.5 [b] c)", "x " * 120, "日本語 emoji 🍎 (café:0.9)"]):
        put(args.out, "prompt", f"p{i}", p)

    if args.fixtures:  # every checkpoint's names and shapes, as fuzz_single_file reads them
        from safetensors import safe_open
        for path in glob.glob(os.path.join(args.fixtures, "**", "*.safetensors"), recursive=True):
            try:
                with safe_open(path, "pt") as f:
                    lines = [" ".join([k] + [str(d) for d in f.get_slice(k).get_shape()]) for k in f.keys()]
            except Exception:
                continue
            text = "\n".join(lines)
            if len(text) <= 65536:
                put(args.out, "single_file", os.path.relpath(path, args.fixtures).replace(os.sep, "_") + ".txt", text)
    put(args.out, "single_file", "sd1-head.txt", "model.diffusion_model.input_blocks.0.0.weight 320 4 3 3\n"
        "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight 320 768\n"
        "first_stage_model.decoder.conv_in.weight 512 4 3 3\n"
        "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight 49408 768\n")
    if args.fixtures:  # the reference scripts' small files
        for path in glob.glob(os.path.join(args.fixtures, "**", "*"), recursive=True):
            if not os.path.isfile(path) or os.path.getsize(path) > 65536:
                continue
            kind = {".safetensors": "safetensors", ".pth": "pth", ".json": "json", ".png": "image"}.get(
                os.path.splitext(path)[1])
            if kind:
                d = os.path.join(args.out, kind)
                os.makedirs(d, exist_ok=True)
                shutil.copy(path, os.path.join(d, os.path.relpath(path, args.fixtures).replace(os.sep, "_")))


if __name__ == "__main__":
    main()
