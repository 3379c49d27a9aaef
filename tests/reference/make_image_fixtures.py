#!/usr/bin/env python3
"""Reference oracle for image-conditioned jobs: diffusers' img2img and inpaint pipelines (SD, SDXL,
SD3) on the tiny seeded models, with inputs whose size differs from the job's.

Reads make_fixtures.py's tiny-sd / tiny-sdxl and make_sd3_pipeline_fixtures.py's tiny-sd3 (--fixtures).
Writes into --out:
  photo.png (75x61 RGB, a crop of skimage's astronaut), photo_alpha.png (the same with a transparent
  hole), mask.png (40x30 grey, soft-edged ellipse: binarisation matters), mask_empty.png (nothing to repaint),
  grey16.png, photo_cmyk.jpg and huge_header.png (what the readers must take or refuse);
  tiny-sd-inpainting/, tiny-sdxl-inpainting/ (9-channel UNets), tiny-sd3-inpainting/ (a 33-channel
  transformer), each the base model's other components;
  resize_cases.safetensors: Pillow's Lanczos resizes of photo.png to several sizes;
  image_cases.json + image_cases.safetensors: per case its settings and diffusers' image (float, HWC).
CPU, fp32, a few seconds.
"""
import argparse
import json
import os

import numpy as np
import torch
from PIL import Image, ImageDraw
from safetensors.torch import save_file

torch.set_grad_enabled(False)


def make_inputs(out):
    from skimage import data
    astronaut = Image.fromarray(data.astronaut()).crop((120, 20, 420, 264))  # 300x244, the face
    photo = astronaut.resize((75, 61), Image.BICUBIC)
    photo.save(os.path.join(out, "photo.png"))
    rgba = photo.convert("RGBA")
    alpha = Image.new("L", photo.size, 255)
    ImageDraw.Draw(alpha).rectangle((20, 15, 50, 40), fill=0)
    rgba.putalpha(alpha)
    rgba.save(os.path.join(out, "photo_alpha.png"))
    mask = Image.new("L", (40, 30), 0)
    draw = ImageDraw.Draw(mask)
    draw.ellipse((8, 5, 30, 24), fill=255)
    draw.ellipse((4, 2, 34, 27), outline=120)  # a ring under 50 %: not repainted
    draw.ellipse((6, 4, 32, 25), outline=140)  # a ring over 50 %: repainted
    mask.save(os.path.join(out, "mask.png"))
    # At the photo's size, for the full-resolution crop (diffusers crops image and mask alike).
    mask.resize(photo.size, Image.NEAREST).save(os.path.join(out, "mask_photo_size.png"))
    Image.new("L", (75, 61), 100).save(os.path.join(out, "mask_empty.png"))  # under 50 % everywhere
    # What users bring: a 16-bit grey PNG, a CMYK JPEG, and a PNG whose header claims 100000² pixels.
    grey16 = (np.array(photo.convert("L"), dtype=np.uint16) * 257)
    Image.fromarray(grey16).save(os.path.join(out, "grey16.png"))  # mode I;16
    photo.convert("CMYK").save(os.path.join(out, "photo_cmyk.jpg"), quality=95)
    import struct, zlib
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    with open(os.path.join(out, "huge_header.png"), "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return photo, mask, rgba


def make_resize_cases(out, photo):
    cases = {}
    for w, h in ((64, 64), (74, 60), (32, 48), (150, 122), (75, 30), (13, 61)):
        cases[f"{w}x{h}"] = torch.from_numpy(np.array(photo.resize((w, h), Image.LANCZOS)))
    save_file(cases, os.path.join(out, "resize_cases.safetensors"))


def inpainting_models(fixtures, out):
    from diffusers import (SD3Transformer2DModel, StableDiffusion3InpaintPipeline, StableDiffusion3Pipeline,
                           StableDiffusionInpaintPipeline, StableDiffusionPipeline, StableDiffusionXLInpaintPipeline,
                           StableDiffusionXLPipeline, UNet2DConditionModel)
    sd = StableDiffusionPipeline.from_pretrained(os.path.join(fixtures, "tiny-sd"))
    xl = StableDiffusionXLPipeline.from_pretrained(os.path.join(fixtures, "tiny-sdxl"))
    sd3 = StableDiffusion3Pipeline.from_pretrained(os.path.join(fixtures, "sd3_pipeline", "tiny-sd3"),
                                                   text_encoder_3=None, tokenizer_3=None)
    models = {}
    for name, pipe, seed in (("sd", sd, 61), ("sdxl", xl, 62)):
        config = dict(pipe.unet.config)
        config["in_channels"] = 9
        torch.manual_seed(seed)
        unet = UNet2DConditionModel.from_config(config).eval()
        cls = StableDiffusionInpaintPipeline if name == "sd" else StableDiffusionXLInpaintPipeline
        components = dict(pipe.components, unet=unet)
        inpaint = cls(**components)
        inpaint.save_pretrained(os.path.join(out, f"tiny-{name}-inpainting"))
        models[name] = inpaint
    config = dict(sd3.transformer.config)
    config["in_channels"] = 33
    transformer = SD3Transformer2DModel.from_config(config).eval()
    g = torch.Generator().manual_seed(63)
    for p in transformer.parameters():
        p.copy_(0.1 * torch.randn(p.shape, generator=g))
    sd3_inpaint = StableDiffusion3InpaintPipeline(**dict(sd3.components, transformer=transformer))
    sd3_inpaint.save_pretrained(os.path.join(out, "tiny-sd3-inpainting"))
    models["sd3"] = sd3_inpaint
    return sd, xl, sd3, models


from make_fixtures import SAMPLERS as SD_SAMPLERS  # noqa: E402 (this folder is on sys.path)

SAMPLERS = dict(SD_SAMPLERS, **{"flow-euler": ("FlowMatchEulerDiscreteScheduler", {})})


def make_cases(fixtures, out, photo, mask):
    import diffusers
    from diffusers import (StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline,
                           StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline,
                           StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline)
    sd, xl, sd3, inpainting = inpainting_models(fixtures, out)
    pipes = {
        ("sd", "img2img"): (StableDiffusionImg2ImgPipeline(**sd.components), "tiny-sd"),
        ("sd", "inpaint"): (StableDiffusionInpaintPipeline(**sd.components), "tiny-sd"),
        ("sd", "inpaint9"): (inpainting["sd"], "image/tiny-sd-inpainting"),
        ("sdxl", "img2img"): (StableDiffusionXLImg2ImgPipeline(**xl.components), "tiny-sdxl"),
        ("sdxl", "inpaint"): (StableDiffusionXLInpaintPipeline(**xl.components), "tiny-sdxl"),
        ("sdxl", "inpaint9"): (inpainting["sdxl"], "image/tiny-sdxl-inpainting"),
        ("sd3", "img2img"): (StableDiffusion3Img2ImgPipeline(**sd3.components), "sd3_pipeline/tiny-sd3"),
        ("sd3", "inpaint"): (StableDiffusion3InpaintPipeline(**sd3.components), "sd3_pipeline/tiny-sd3"),
        ("sd3", "inpaint33"): (inpainting["sd3"], "image/tiny-sd3-inpainting"),
    }
    saved = {key: dict(p.scheduler.config) for key, (p, _) in pipes.items()}
    cases, index = {}, []

    def run(name, family, kind, sampler, seed, strength, width=None, height=None, cfg=7.5, steps=5,
            negative=None, padding_mask_crop=None, image_file="photo.png", mask_file="mask.png"):
        pipe, folder = pipes[(family, kind)]
        cls, extra = SAMPLERS[sampler]
        pipe.scheduler = getattr(diffusers, cls).from_config(saved[(family, kind)], **extra)
        image = Image.open(os.path.join(out, image_file)).convert("RGB")
        kw = dict(prompt="a portrait in a spacesuit", negative_prompt=negative, num_inference_steps=steps,
                  guidance_scale=cfg, strength=strength, generator=torch.Generator().manual_seed(seed),
                  output_type="np")
        if kind == "img2img" and family in ("sd", "sdxl"):
            # These pipelines take no size: the image's own, cut to a multiple of the VAE factor,
            # unless it comes resized (VaeImageProcessor.resize: Pillow's Lanczos).
            if width is not None:
                image = image.resize((width, height), Image.LANCZOS)
            result = pipe(image=image, **kw).images
        else:
            extra_kw = {} if kind == "img2img" else {"mask_image": Image.open(os.path.join(out, mask_file))}
            if padding_mask_crop is not None:
                extra_kw["padding_mask_crop"] = padding_mask_crop
                kw["output_type"] = "pil"  # diffusers pastes the crop back in PIL only
            if family == "sd3" and kind != "img2img":
                # diffusers 0.42.1's SD3 inpaint pipeline decodes latents / scaling_factor without
                # adding the VAE's shift_factor back (its txt2img and img2img pipelines add it):
                # its latents are the reference, decoded as the other SD3 pipelines decode.
                kw["output_type"] = "latent"
                latents = pipe(image=image, height=height, width=width, **kw, **extra_kw).images
                vae = pipe.vae
                decoded = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample
                result = pipe.image_processor.postprocess(decoded, output_type="np")
            else:
                result = pipe(image=image, height=height, width=width, **kw, **extra_kw).images
        if isinstance(result, list):  # PIL images
            result = np.stack([np.asarray(i, dtype=np.float32) / 255.0 for i in result])
        cases[name] = torch.from_numpy(np.ascontiguousarray(result))
        index.append({"name": name, "model": folder, "kind": kind, "sampler": sampler, "seed": seed,
                      "strength": strength, "width": width or 0, "height": height or 0, "cfg": cfg,
                      "steps": steps, "negative_prompt": negative or "", "prompt": kw["prompt"],
                      "image": image_file, "mask": "" if kind == "img2img" else mask_file,
                      "full_res_padding": -1 if padding_mask_crop is None else padding_mask_crop,
                      "out_width": int(result.shape[2]), "out_height": int(result.shape[1])})

    for sampler in ("euler", "euler-ancestral", "ddim", "ddpm", "dpmpp-2m", "dpmpp-2m-karras"):
        run(f"sd.img2img.{sampler}", "sd", "img2img", sampler, 31, 0.6, 64, 64)
    run("sd.img2img.default-size", "sd", "img2img", "euler", 32, 0.75)
    run("sd.img2img.strength1", "sd", "img2img", "dpmpp-2m", 33, 1.0, 48, 64, negative="blurry")
    run("sd.inpaint.euler", "sd", "inpaint", "euler", 34, 1.0, 64, 64)
    run("sd.inpaint.euler-ancestral.0.7", "sd", "inpaint", "euler-ancestral", 35, 0.7, 64, 64)
    run("sd.inpaint.ddim.0.8", "sd", "inpaint", "ddim", 36, 0.8, 64, 48)
    run("sd.inpaint9.euler", "sd", "inpaint9", "euler", 37, 1.0, 64, 64)
    run("sd.inpaint.full-res", "sd", "inpaint", "euler", 39, 1.0, 64, 64, padding_mask_crop=4,
        mask_file="mask_photo_size.png")
    run("sd.inpaint9.dpmpp-2m.0.6", "sd", "inpaint9", "dpmpp-2m", 38, 0.6, 64, 64)
    run("sdxl.img2img.euler", "sdxl", "img2img", "euler", 41, 0.6, 96, 64)
    run("sdxl.inpaint.euler-ancestral", "sdxl", "inpaint", "euler-ancestral", 42, 1.0, 64, 64)
    run("sdxl.inpaint9.ddim.0.8", "sdxl", "inpaint9", "ddim", 43, 0.8, 64, 64)
    run("sd3.img2img", "sd3", "img2img", "flow-euler", 51, 0.6, 64, 64, cfg=5.0)
    run("sd3.inpaint", "sd3", "inpaint", "flow-euler", 52, 1.0, 64, 64, cfg=5.0)
    run("sd3.inpaint.0.8", "sd3", "inpaint", "flow-euler", 53, 0.8, 64, 48, cfg=5.0)
    run("sd3.inpaint33", "sd3", "inpaint33", "flow-euler", 54, 1.0, 64, 64, cfg=5.0)

    # The hires fix as diffusers would run it: text-to-image, the upscale, then img2img from the
    # upscaled latents (or the Lanczos-resized image) with the same generator carried on.
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    for name, family, upscaler, sampler, seed in (("sd.hires.latent", "sd", "latent", "euler", 71),
                                                  ("sd.hires.lanczos", "sd", "lanczos", "dpmpp-2m", 72),
                                                  ("sdxl.hires.latent", "sdxl", "latent", "euler-ancestral", 73)):
        i2i, folder = pipes[(family, "img2img")]
        t2i = (StableDiffusionPipeline if family == "sd" else StableDiffusionXLPipeline)(**i2i.components)
        cls, extra = SAMPLERS[sampler]
        t2i.scheduler = getattr(diffusers, cls).from_config(saved[(family, "img2img")], **extra)
        i2i.scheduler = getattr(diffusers, cls).from_config(saved[(family, "img2img")], **extra)
        g = torch.Generator().manual_seed(seed)
        kw = dict(prompt="a portrait in a spacesuit", num_inference_steps=5, guidance_scale=7.5, generator=g)
        if upscaler == "latent":
            latents = t2i(height=32, width=32, output_type="latent", **kw).images
            start = torch.nn.functional.interpolate(latents, scale_factor=2, mode="bicubic", align_corners=False)
        else:
            start = t2i(height=32, width=32, output_type="pil", **kw).images[0].resize((64, 64), Image.LANCZOS)
        result = i2i(image=start, strength=0.5, output_type="np", **kw).images
        cases[name] = torch.from_numpy(np.ascontiguousarray(result))
        index.append({"name": name, "model": folder, "kind": "hires", "sampler": sampler, "seed": seed, "strength": 0.5,
                      "width": 32, "height": 32, "cfg": 7.5, "steps": 5, "negative_prompt": "", "prompt": kw["prompt"],
                      "image": "", "mask": "", "full_res_padding": -1, "hires_scale": 2.0, "upscaler": upscaler,
                      "out_width": int(result.shape[2]), "out_height": int(result.shape[1])})
    save_file(cases, os.path.join(out, "image_cases.safetensors"))
    with open(os.path.join(out, "image_cases.json"), "w") as f:
        json.dump(index, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures", required=True, help="make_fixtures.py's output (tiny-sd, tiny-sdxl, sd3_pipeline)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    photo, mask, _ = make_inputs(args.out)
    make_resize_cases(args.out, photo)
    make_cases(args.fixtures, args.out, photo, mask)
    with open(os.path.join(args.out, "STAMP"), "w") as f:
        f.write("ok\n")


if __name__ == "__main__":
    main()
