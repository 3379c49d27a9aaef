"""diffusers (peft) loads the LoRA diffract-train exports (test_training writes it beside the
tiny model it was trained on, with our latents): the same prompt and seed with the LoRA must
give the same final latents as Diffract's pipeline with it, and without it the same as without."""
import argparse
import json

import torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file

ap = argparse.ArgumentParser()
ap.add_argument("base")
ap.add_argument("lora_dir")
args = ap.parse_args()
req = json.load(open(f"{args.lora_dir}/diffract_request.json"))
ours = load_file(f"{args.lora_dir}/diffract_latents.safetensors")
pipe = StableDiffusionPipeline.from_pretrained(args.base, torch_dtype=torch.float32, safety_checker=None)


def run():
    g = torch.Generator("cpu").manual_seed(req["seed"])
    with torch.no_grad():
        return pipe(req["prompt"], num_inference_steps=req["steps"], guidance_scale=req["cfg"], height=req["size"],
                    width=req["size"], generator=g, output_type="latent").images


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


without = run()
pipe.load_lora_weights(args.lora_dir, weight_name="lora.safetensors")
adapted_modules = sum(1 for _, m in pipe.unet.named_modules() if hasattr(m, "lora_A") and len(m.lora_A) > 0)
print(f"peft adapted {adapted_modules} UNet modules")
assert adapted_modules == len(load_file(f"{args.lora_dir}/lora.safetensors")) // 2
with_lora = run()
e_plain, e_lora = rel(without, ours["without"]), rel(with_lora, ours["with_lora"])
print(f"final latents without the LoRA: relative L2 {e_plain:.2e}; with it: {e_lora:.2e}; "
      f"the LoRA moves diffusers' latents by {rel(with_lora, without):.2e}")
assert e_plain < 1e-3 and e_lora < 1e-3, (e_plain, e_lora)
print("diffusers LoRA parity ok")
