"""Anchor timings for ControlNet on the GPU machine: diffusers' StableDiffusionXLControlNetPipeline
(PyTorch eager) with one ControlNet made from the UNet (ControlNetModel.from_unet), on the full-size
SDXL config with random weights, bf16, 1024², 30 steps, CFG 7, next to its text-to-image pipeline
in the same process. The configs are those of diffusers_sdxl_image_inputs.py. Prints `RES name value`
lines and a RESULT JSON line."""
import json, os, time, torch
from PIL import Image
from diffusers import (AutoencoderKL, ControlNetModel, EulerDiscreteScheduler, StableDiffusionXLControlNetPipeline,
                       StableDiffusionXLPipeline, UNet2DConditionModel)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
res = {}
def put(k, v):
    res[k] = v; print("RES", k, v, flush=True)
def timed(f, n=3):
    f(); torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]

UNET = dict(act_fn="silu", addition_embed_type="text_time", addition_embed_type_num_heads=64, addition_time_embed_dim=256,
  attention_head_dim=[5, 10, 20], block_out_channels=[320, 640, 1280], cross_attention_dim=2048,
  down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], in_channels=4, layers_per_block=2,
  mid_block_type="UNetMidBlock2DCrossAttn", norm_eps=1e-5, norm_num_groups=32, out_channels=4,
  projection_class_embeddings_input_dim=2816, sample_size=128, transformer_layers_per_block=[1, 2, 10],
  up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], use_linear_projection=True)
VAE = dict(act_fn="silu", block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
  force_upcast=True, in_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32, out_channels=3,
  sample_size=1024, scaling_factor=0.13025, up_block_types=["UpDecoderBlock2D"] * 4)
unet = UNet2DConditionModel(**UNET).to(dev, dt).eval()
with torch.no_grad():
    for p in unet.parameters(): p.mul_(0.5)
vae = AutoencoderKL(**VAE).to(dev, dt).eval()
te1 = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                   projection_dim=768, hidden_act="quick_gelu")).to(dev, dt).eval()
te2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                                 num_attention_heads=20, projection_dim=1280, hidden_act="gelu")).to(dev, dt).eval()
sched = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                               steps_offset=1, timestep_spacing="leading")
parts = dict(vae=vae, text_encoder=te1, text_encoder_2=te2, tokenizer=None, tokenizer_2=None, unet=unet, scheduler=sched)
pe = torch.randn(1, 77, 2048, device=dev, dtype=dt); ppe = torch.randn(1, 1280, device=dev, dtype=dt)
embeds = dict(prompt_embeds=pe, pooled_prompt_embeds=ppe, negative_prompt_embeds=pe * 0, negative_pooled_prompt_embeds=ppe * 0,
              num_inference_steps=30, guidance_scale=7.0)
x = torch.linspace(0, 255, 1024).round().byte()
image = Image.fromarray(torch.stack([x.expand(1024, 1024), x.view(-1, 1).expand(1024, 1024),
                                     torch.full((1024, 1024), 128, dtype=torch.uint8)], -1).numpy())
controlnet = ControlNetModel.from_unet(unet).to(dev, dt).eval()
with torch.no_grad():
    t2i = StableDiffusionXLPipeline(**parts); t2i.set_progress_bar_config(disable=True)
    put("txt2img_s", timed(lambda: t2i(height=1024, width=1024, **embeds)))
    cn = StableDiffusionXLControlNetPipeline(**parts, controlnet=controlnet); cn.set_progress_bar_config(disable=True)
    put("controlnet_s", timed(lambda: cn(image=image, height=1024, width=1024, **embeds)))
    put("controlnet_added_per_step_ms", (res["controlnet_s"] - res["txt2img_s"]) / 30 * 1e3)
print("RESULT " + json.dumps(res))
