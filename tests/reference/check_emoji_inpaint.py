"""diffusers runs the inpainting model diffract-train exports (test_training writes it with our
latents, the image and the mask): StableDiffusionInpaintPipeline with the same prompt, seed,
image and mask must give the same final latents as Diffract's pipeline.

The emoji model's latents have 32 channels, so its inpainting UNet takes 2 x 32 + 1 = 65;
diffusers' pipeline gates its inpainting-model branch on exactly 9 (SD's 4 + 1 + 4). The gate
alone is widened here to 2 x latent channels + 1 (the layout the 9 stands for); every step of
the algorithm stays diffusers' own. Its AutoencoderTiny lacks TAEF2's mid-block branch (the
`pool.*` weights), which encodes the masked image here: make_vae_fixtures attaches it, as the
TAEF2 oracle test does."""
import argparse
import collections
import inspect
import os
import sys
import json
import textwrap

import torch
from diffusers import StableDiffusionInpaintPipeline
from PIL import Image
from safetensors.torch import load_file

ap = argparse.ArgumentParser()
ap.add_argument("dir")
args = ap.parse_args()
d = args.dir
req = json.load(open(f"{d}/diffract_request.json"))
import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint as module

source = textwrap.dedent(inspect.getsource(StableDiffusionInpaintPipeline.__call__))
gate = "num_channels_unet == 9"
assert source.count(gate) == 2, "diffusers' inpainting pipeline changed: review the widened gate"
namespace = {}
exec(source.replace(gate, "num_channels_unet == 2 * num_channels_latents + 1"), vars(module), namespace)


class WideInpaintPipeline(StableDiffusionInpaintPipeline):
    __call__ = namespace["__call__"]


pipe = WideInpaintPipeline.from_pretrained(d, torch_dtype=torch.float32, safety_checker=None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_vae_fixtures import add_midblock_norm  # noqa: E402

pools = collections.defaultdict(dict)
for key, value in load_file(f"{d}/vae/diffusion_pytorch_model.safetensors").items():
    part, _, index, branch, rest = key.split(".", 4) if ".pool." in key else (None,) * 5
    if part:
        pools[(part, int(index))][rest] = value.float()
assert pools, "TAEF2 has mid-block branches"
for (part, index), state in pools.items():
    add_midblock_norm(getattr(pipe.vae, part).layers[index], state)
assert pipe.unet.config.in_channels == 2 * pipe.vae.config.latent_channels + 1
g = torch.Generator("cpu").manual_seed(req["seed"])
with torch.no_grad():
    theirs = pipe(req["prompt"], image=Image.open(f"{d}/diffract_image.png").convert("RGB"),
                  mask_image=Image.open(f"{d}/diffract_mask.png").convert("L"), strength=1.0,
                  num_inference_steps=req["steps"], guidance_scale=req["cfg"], height=req["size"], width=req["size"],
                  generator=g, output_type="latent").images
ours = load_file(f"{d}/diffract_latents.safetensors")["latents"]
err = ((theirs - ours).norm() / theirs.norm()).item()
print(f"final latents {tuple(ours.shape)}: relative L2 {err:.2e}, max abs {(theirs - ours).abs().max().item():.2e}")
assert err < 1e-3, err
print("diffusers inpainting parity ok")
