#!/usr/bin/env python3
"""PNGs carrying other programs' generation parameters, written with Pillow as those programs do.

a1111.png: AUTOMATIC1111's "parameters" tEXt chunk (prompt, negative prompt, settings line).
comfyui.png: ComfyUI's "prompt" (API graph) and "workflow" tEXt chunks, from its default
text-to-image graph with a LoRA loader added.
no_parameters.png: only an unrelated text chunk.
"""
import argparse
import json
import pathlib

from PIL import Image
from PIL.PngImagePlugin import PngInfo

A1111 = (
    "studio packshot of a ceramic coffee mug, centered,\n"
    "on a seamless white background <lora:product_v2:0.7>\n"
    "Negative prompt: text, watermark,\n"
    "blurry\n"
    "Steps: 28, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 6.5, Seed: 3141592653, "
    "Size: 1152x896, Model hash: 31e35c80fc, Model: sd_xl_base_1.0, Clip skip: 2, "
    'Lora hashes: "product_v2: 1a2b3c4d5e6f, other: 0f0f0f", Version: v1.10.1'
)

COMFY_PROMPT = {
    "3": {"inputs": {"seed": 156680208700286, "steps": 20, "cfg": 8.0, "sampler_name": "euler",
                     "scheduler": "normal", "denoise": 1.0, "model": ["10", 0], "positive": ["6", 0],
                     "negative": ["7", 0], "latent_image": ["5", 0]},
          "class_type": "KSampler", "_meta": {"title": "KSampler"}},
    "4": {"inputs": {"ckpt_name": "v1-5-pruned-emaonly.safetensors"},
          "class_type": "CheckpointLoaderSimple", "_meta": {"title": "Load Checkpoint"}},
    "5": {"inputs": {"width": 512, "height": 768, "batch_size": 1},
          "class_type": "EmptyLatentImage", "_meta": {"title": "Empty Latent Image"}},
    "6": {"inputs": {"text": "beautiful scenery nature glass bottle landscape, purple galaxy bottle,",
                     "clip": ["10", 1]},
          "class_type": "CLIPTextEncode", "_meta": {"title": "CLIP Text Encode (Prompt)"}},
    "7": {"inputs": {"text": "text, watermark", "clip": ["10", 1]},
          "class_type": "CLIPTextEncode", "_meta": {"title": "CLIP Text Encode (Prompt)"}},
    "8": {"inputs": {"samples": ["3", 0], "vae": ["4", 2]},
          "class_type": "VAEDecode", "_meta": {"title": "VAE Decode"}},
    "9": {"inputs": {"filename_prefix": "ComfyUI", "images": ["8", 0]},
          "class_type": "SaveImage", "_meta": {"title": "Save Image"}},
    "10": {"inputs": {"lora_name": "glass_style.safetensors", "strength_model": 0.8, "strength_clip": 0.8,
                      "model": ["4", 0], "clip": ["4", 1]},
           "class_type": "LoraLoader", "_meta": {"title": "Load LoRA"}},
}

# The UI graph ComfyUI stores beside the prompt (abridged: Diffract reads "prompt" only).
COMFY_WORKFLOW = {"last_node_id": 10, "last_link_id": 12, "version": 0.4,
                  "nodes": [{"id": int(k), "type": v["class_type"]} for k, v in COMFY_PROMPT.items()], "links": []}


def save(path, chunks):
    img = Image.new("RGB", (64, 48), (200, 120, 40))
    info = PngInfo()
    for key, value in chunks:
        info.add_text(key, value)
    img.save(path, pnginfo=info)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = pathlib.Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    save(out / "a1111.png", [("parameters", A1111)])
    save(out / "comfyui.png", [("prompt", json.dumps(COMFY_PROMPT)), ("workflow", json.dumps(COMFY_WORKFLOW))])
    save(out / "no_parameters.png", [("Software", "GIMP 2.10")])
    print(f"wrote a1111.png, comfyui.png, no_parameters.png to {out}")


if __name__ == "__main__":
    main()
