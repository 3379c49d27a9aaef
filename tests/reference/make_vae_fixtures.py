#!/usr/bin/env python3
"""Reference oracle for the autoencoders: diffusers' AutoencoderKL / AutoencoderTiny and the
real TAEF2 weights, with their outputs.

Writes into --out (the build tree, never committed):
  kl-sd/, kl-flux/            tiny seeded AutoencoderKL folders (save_pretrained layout)
  kl_cases.safetensors        their inputs, encode mean / logvar, a seeded sample, decode outputs
  tiny4/, tiny16/             tiny seeded AutoencoderTiny folders (save_pretrained layout)
  tiny4-pth/                  the tiny4 weights again as madebyollin/taesd's encoder / decoder .pth pair
  tiny_cases.safetensors      their encode / decode outputs
  taesd-bad/                  a decoder .pth whose shapes fit no TAESD variant
  taef2_cases.safetensors     the real TAEF2 weights on a real photograph (see make_taef2)
Runs on CPU in seconds.
"""
import argparse
import collections
import json
import os
import re
import types

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import save_file

torch.set_grad_enabled(False)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


def images(seed, shape):
    """Smooth image-like inputs in [-1, 1] (random fields blurred by upsampling)."""
    g = torch.Generator().manual_seed(seed)
    b, c, h, w = shape
    coarse = torch.rand(b, c, h // 4, w // 4, generator=g) * 2 - 1
    return torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False).clamp(-1, 1)


# --- AutoencoderKL ------------------------------------------------------------------------------
def make_kl(out):
    from diffusers import AutoencoderKL

    cases = {}
    configs = {
        # SD / SDXL layout: 4 latent channels, quant convs, mid-block attention.
        "sd": dict(block_out_channels=[8, 16, 32, 32], layers_per_block=2, latent_channels=4, norm_num_groups=4,
                   down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                   sample_size=32, scaling_factor=0.13025, force_upcast=True),
        # SD3 / FLUX layout: 16 latent channels, no quant convs, shift_factor; the mid-block
        # attention switched off to cover that option too.
        "flux": dict(block_out_channels=[16, 16, 32], layers_per_block=1, latent_channels=16, norm_num_groups=8,
                     down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3,
                     sample_size=32, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                     use_post_quant_conv=False, mid_block_add_attention=False, force_upcast=False),
    }
    for i, (name, cfg) in enumerate(configs.items()):
        torch.manual_seed(10 + i)
        vae = AutoencoderKL(**cfg).eval()
        # Default init leaves the convs' output near zero: perturb every parameter so that each
        # layer (GroupNorm affine included) contributes visibly to the outputs compared.
        g = torch.Generator().manual_seed(20 + i)
        for p in vae.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        vae.save_pretrained(os.path.join(out, f"kl-{name}"))
        x = images(30 + i, (2, 3, 32, 40))
        dist = vae.encode(x).latent_dist
        gen = torch.Generator().manual_seed(1234)
        sample = dist.sample(generator=gen)
        z = torch.randn(dist.mean.shape, generator=torch.Generator().manual_seed(40 + i))
        cases.update({
            f"{name}.images": x, f"{name}.mean": dist.mean, f"{name}.logvar": dist.logvar,
            f"{name}.sample": sample,  # seed 1234, CPU generator
            f"{name}.decoded_mean": vae.decode(dist.mean).sample,
            f"{name}.z": z, f"{name}.decoded_z": vae.decode(z).sample,
        })
    save_file({k: v.contiguous() for k, v in cases.items()}, os.path.join(out, "kl_cases.safetensors"))


# --- AutoencoderTiny ----------------------------------------------------------------------------
def to_original_layout(state, part):
    """diffusers' AutoencoderTiny keys -> madebyollin/taesd's nn.Sequential keys for one part.

    The original decoder starts with a parameter-free Clamp at index 0, which diffusers folds
    into DecoderTiny.forward, so original decoder indices are diffusers' plus one.
    """
    shift = 1 if part == "decoder" else 0
    sd = collections.OrderedDict()
    for k, v in state.items():
        m = re.match(rf"{part}\.layers\.(\d+)\.(.*)", k)
        if m:
            sd[f"{int(m.group(1)) + shift}.{m.group(2)}"] = v.clone()
    return sd


def make_tiny(out):
    from diffusers import AutoencoderTiny

    cases = {}
    configs = {
        # The published TAESD / TAESDXL architecture (64 channels, 1-3-3-3 blocks), 4 latent channels.
        "tiny4": dict(latent_channels=4),
        # A reduced custom config, 16 latent channels (TAESD3 / TAEF1 count).
        "tiny16": dict(latent_channels=16, encoder_block_out_channels=[16] * 4, decoder_block_out_channels=[16] * 4,
                       num_encoder_blocks=[1, 1, 2, 1], num_decoder_blocks=[1, 2, 1, 1]),
    }
    for i, (name, cfg) in enumerate(configs.items()):
        torch.manual_seed(50 + i)
        tae = AutoencoderTiny(**cfg).eval()
        tae.save_pretrained(os.path.join(out, name))
        x = images(60 + i, (2, 3, 48, 64))
        latents = tae.encode(x).latents
        z = torch.randn(latents.shape, generator=torch.Generator().manual_seed(70 + i)) * 2
        cases.update({f"{name}.images": x, f"{name}.latents": latents, f"{name}.z": z,
                      f"{name}.decoded_z": tae.decode(z).sample, f"{name}.decoded_latents": tae.decode(latents).sample})
        if name == "tiny4":
            d = os.path.join(out, "tiny4-pth")
            os.makedirs(d, exist_ok=True)
            state = tae.state_dict()
            torch.save(to_original_layout(state, "encoder"), os.path.join(d, "taesd_encoder.pth"))
            torch.save(to_original_layout(state, "decoder"), os.path.join(d, "taesd_decoder.pth"))
            # Shapes of no variant: a decoder for 8 latent channels.
            bad = to_original_layout(state, "decoder")
            bad["1.weight"] = torch.zeros(64, 8, 3, 3)
            os.makedirs(os.path.join(out, "taesd-bad"), exist_ok=True)
            torch.save(bad, os.path.join(out, "taesd-bad", "taesd_decoder.pth"))
    save_file({k: v.contiguous() for k, v in cases.items()}, os.path.join(out, "tiny_cases.safetensors"))


# --- TAEF2 (real weights) -----------------------------------------------------------------------
def add_midblock_norm(block, pool_state):
    """Gives a diffusers AutoencoderTinyBlock the FLUX.2 variant's extra branch.

    madebyollin/taesd's Block(use_midblock_gn=True) adds, before the usual convs, a residual
    x + pool(x) with pool = 1x1 conv (C -> 4C, no bias), GroupNorm(4 groups), ReLU,
    1x1 conv (4C -> C, no bias); diffusers' block has no such branch, so it is attached here.
    """
    c = block.conv[0].in_channels
    pool = nn.Sequential(nn.Conv2d(c, 4 * c, 1, bias=False), nn.GroupNorm(4, 4 * c), nn.ReLU(),
                         nn.Conv2d(4 * c, c, 1, bias=False))
    pool.load_state_dict(pool_state)
    block.pool = pool
    plain = block.forward

    def forward(self, x):
        return plain(x + self.pool(x))

    block.forward = types.MethodType(forward, block)


def load_taef2(shared):
    """The original TAEF2 .pth pair in a diffusers AutoencoderTiny of the right shape."""
    from diffusers import AutoencoderTiny

    tae = AutoencoderTiny(latent_channels=32).eval()
    for part, shift in (("encoder", 0), ("decoder", 1)):
        sd = torch.load(os.path.join(shared, "data", "taesd", f"taef2_{part}.pth"), map_location="cpu",
                        weights_only=True)
        layers = getattr(tae, part).layers
        plain, pools = {}, collections.defaultdict(dict)
        for k, v in sd.items():
            idx, rest = k.split(".", 1)
            i = int(idx) - shift
            if rest.startswith("pool."):
                pools[i][rest[len("pool."):]] = v.float()
            else:
                plain[f"{i}.{rest}"] = v.float()
        layers.load_state_dict(plain, strict=True)
        for i, pool_state in pools.items():
            add_midblock_norm(layers[i], pool_state)
    return tae


def make_taef2(out, shared):
    from PIL import Image
    import skimage

    # scikit-image's astronaut.png (NASA photograph of Eileen Collins, public domain), 512x512 RGB.
    src = os.path.join(os.path.dirname(skimage.__file__), "data", "astronaut.png")
    rgb = np.asarray(Image.open(src).convert("RGB"), dtype=np.float32) / 255.0
    photo = torch.from_numpy(rgb).permute(2, 0, 1).unsqueeze(0).contiguous() * 2 - 1  # [1, 3, 512, 512] in [-1, 1]
    tae = load_taef2(shared)
    latents = tae.encode(photo).latents
    decoded = tae.decode(latents).sample
    mse = ((decoded.clamp(-1, 1) - photo) / 2).pow(2).mean().item()
    psnr = 10 * np.log10(1.0 / mse)
    z = torch.randn(1, 32, 8, 8, generator=torch.Generator().manual_seed(80)) * 2
    save_file({"photo": photo, "latents": latents, "decoded": decoded, "z": z, "decoded_z": tae.decode(z).sample,
               "psnr": torch.tensor([psnr], dtype=torch.float64)},
              os.path.join(out, "taef2_cases.safetensors"))
    print(f"TAEF2 round trip of astronaut.png: PSNR {psnr:.2f} dB")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shared", required=True, help="the shared/ folder (TAEF2 weights)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    make_kl(args.out)
    make_tiny(args.out)
    make_taef2(args.out, args.shared)
    with open(os.path.join(args.out, "STAMP"), "w") as f:
        f.write("ok\n")


if __name__ == "__main__":
    main()
