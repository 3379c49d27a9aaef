"""diffusers runs the folder diffract-train exports (test_training writes it, with our latents):
the same prompt, seed, sampler and steps must give the same final latents."""
import argparse
import json

import torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file

ap = argparse.ArgumentParser()
ap.add_argument("dir")
args = ap.parse_args()
d = args.dir
for f in ("unet/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
    sd = load_file(f"{d}/{f}")  # the safetensors package reads our writer's files
    assert sd and all(v.dtype == torch.float16 for v in sd.values()), f
req = json.load(open(f"{d}/diffract_request.json"))
pipe = StableDiffusionPipeline.from_pretrained(d, torch_dtype=torch.float32, safety_checker=None)
assert type(pipe.vae).__name__ == "AutoencoderTiny" and pipe.vae_scale_factor == 8
g = torch.Generator("cpu").manual_seed(req["seed"])
with torch.no_grad():
    theirs = pipe(req["prompt"], num_inference_steps=req["steps"], guidance_scale=req["cfg"], height=req["size"],
                  width=req["size"], generator=g, output_type="latent").images
saved = load_file(f"{d}/diffract_latents.safetensors")
ours = saved["latents"]

# The training objective: diffusers' own training scheduler from the exported settings.
from diffusers import DDPMScheduler
train = DDPMScheduler.from_config(pipe.scheduler.config)
assert train.config.prediction_type == "v_prediction" and train.config.rescale_betas_zero_snr
ac = train.alphas_cumprod
err_ac = (ac - saved["alphas_cumprod"]).abs().max().item()
print(f"training alphas_cumprod: max abs {err_ac:.2e} (last {ac[-1].item():.1e})")
assert err_ac < 1e-6, err_ac
t = saved["timesteps"]
for name, theirs_t in (("noisy", train.add_noise(saved["x0"], saved["noise"], t)),
                       ("velocity", train.get_velocity(saved["x0"], saved["noise"], t))):
    e = (theirs_t - saved[name]).abs().max().item()
    print(f"{name}: max abs {e:.2e}")
    assert e < 1e-5, (name, e)

err = ((theirs - ours).norm() / theirs.norm()).item()
print(f"final latents {tuple(ours.shape)}: relative L2 {err:.2e}, max abs {(theirs - ours).abs().max().item():.2e}")
assert err < 1e-3, err
print("diffusers parity ok")
