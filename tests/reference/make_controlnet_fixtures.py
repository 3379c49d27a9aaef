#!/usr/bin/env python3
"""Reference oracle for ControlNet: tiny seeded ControlNets made from make_fixtures.py's tiny-sd /
tiny-sdxl UNets (ControlNetModel.from_unet, the zero convolutions given seeded values so that they
act), and diffusers' StableDiffusionControlNetPipeline / StableDiffusionXLControlNetPipeline images:
one ControlNet, a guidance window (start / end), two at once, SDXL's; the control image of another
size than the job's (diffusers resizes it with Lanczos).

Writes into --out: cn-sd-a/, cn-sd-b/, cn-sdxl/, cn-sd-g32/ (ControlNetModel folders; the last
also as cn-sd-g32.safetensors, its weights alone), edges.png (50x40),
blobs.png (64x64), controlnet_cases.json and controlnet_cases.safetensors (images, float HWC).

And lllyasviel's original layout: cn-ldm/ (a ControlNetModel folder with the original's eight-conv
hint block), the same weights renamed to the ldm keys as control_tiny_sd15.safetensors (under
`control_model.`, beside tensors of a bundled base model, as ControlNet 1.0's files) and
control_tiny_v11.pth (bare keys, as 1.1's); diffusers' from_single_file must read both back to
the folder's weights exactly. controlnet_ldm_case.safetensors: one forward's inputs and its
residuals (down.N, mid) from diffusers.
CPU, fp32, seconds.
"""
import argparse
import json
import os

import torch
from PIL import Image, ImageDraw
from safetensors.torch import save_file

torch.set_grad_enabled(False)


def controlnet_for(unet, seed):
    from diffusers import ControlNetModel
    torch.manual_seed(seed)
    # The tiny VAEs downscale by 2: one stride-2 stage in the conditioning embedding.
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16))
    g = torch.Generator().manual_seed(seed)
    for name, p in net.named_parameters():
        if name.startswith(("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding")):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return net.eval()


RESNET_TO_LDM = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
                 "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def to_ldm_key(key, layers):
    """A diffusers ControlNetModel key -> lllyasviel's (cldm) key."""
    parts = key.split(".")
    head = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
            "time_embedding.linear_2": "time_embed.2", "controlnet_mid_block": "middle_block_out.0",
            "controlnet_cond_embedding.conv_in": "input_hint_block.0",
            "controlnet_cond_embedding.conv_out": "input_hint_block.14"}
    for k in sorted(head, key=len, reverse=True):
        if key.startswith(k + "."):
            return head[k] + key[len(k):]
    if parts[0] == "controlnet_cond_embedding":  # blocks.k
        return f"input_hint_block.{2 * int(parts[2]) + 2}." + ".".join(parts[3:])
    if parts[0] == "controlnet_down_blocks":
        return f"zero_convs.{parts[1]}.0." + ".".join(parts[2:])
    if parts[0] == "down_blocks":
        b, kind, l, rest = int(parts[1]), parts[2], int(parts[3]), parts[4:]
        block = 1 + b * (layers + 1) + l
        if kind == "resnets":
            return f"input_blocks.{block}.0.{RESNET_TO_LDM.get(rest[0], rest[0])}." + ".".join(rest[1:])
        if kind == "attentions":
            return f"input_blocks.{block}.1." + ".".join(rest)
        return f"input_blocks.{1 + b * (layers + 1) + layers}.0.op." + ".".join(rest[1:])  # downsamplers.0.conv
    if parts[0] == "mid_block":
        kind, l, rest = parts[1], int(parts[2]), parts[3:]
        if kind == "attentions":
            return "middle_block.1." + ".".join(rest)
        return f"middle_block.{2 * l}.{RESNET_TO_LDM.get(rest[0], rest[0])}." + ".".join(rest[1:])
    raise KeyError(key)


def write_ldm_controlnet(base_net, out):
    """cn-ldm/ and its two original-layout files; returns the diffusers net."""
    from diffusers import ControlNetModel
    # The original's hint block has eight convolutions (three stride-2 pairs, 8x down): diffusers'
    # converter reads conv_out at input_hint_block.14 only. The rest of the net is base_net's.
    net = ControlNetModel.from_config(dict(base_net.config), conditioning_embedding_out_channels=(4, 8, 8, 16)).eval()
    weights = {k: v for k, v in base_net.state_dict().items() if not k.startswith("controlnet_cond_embedding.")}
    g = torch.Generator().manual_seed(95)
    for name, p in net.controlnet_cond_embedding.named_parameters():
        weights["controlnet_cond_embedding." + name] = torch.randn(p.shape, generator=g) * 0.2
    net.load_state_dict(weights)
    folder = os.path.join(out, "cn-ldm")
    net.save_pretrained(folder)
    layers = net.config.layers_per_block
    ldm = {to_ldm_key(k, layers): v.contiguous() for k, v in net.state_dict().items()}
    assert len(ldm) == len(net.state_dict())
    bundled = {"control_model." + k: v for k, v in ldm.items()}
    bundled["model.diffusion_model.input_blocks.0.0.weight"] = torch.zeros(32, 4, 3, 3)
    bundled["first_stage_model.decoder.conv_in.weight"] = torch.zeros(8, 4, 3, 3)
    save_file(bundled, os.path.join(out, "control_tiny_sd15.safetensors"))
    torch.save(ldm, os.path.join(out, "control_tiny_v11.pth"))
    want = net.state_dict()
    for name in ("control_tiny_sd15.safetensors", "control_tiny_v11.pth"):
        back = ControlNetModel.from_single_file(os.path.join(out, name), config=folder, local_files_only=True)
        got = back.state_dict()
        assert set(got) == set(want), (name, set(got) ^ set(want))
        for k in want:
            assert torch.equal(got[k], want[k]), (name, k)
    return net


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from diffusers import (EulerDiscreteScheduler, StableDiffusionControlNetPipeline, StableDiffusionPipeline,
                           StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline)
    sd = StableDiffusionPipeline.from_pretrained(os.path.join(args.fixtures, "tiny-sd"))
    xl = StableDiffusionXLPipeline.from_pretrained(os.path.join(args.fixtures, "tiny-sdxl"))
    nets = {"cn-sd-a": controlnet_for(sd.unet, 91), "cn-sd-b": controlnet_for(sd.unet, 92),
            "cn-sdxl": controlnet_for(xl.unet, 93)}
    for name, net in nets.items():
        net.save_pretrained(os.path.join(args.out, name))
    # A ControlNet with SD's 32 norm groups (what a config-less single file implies), as a folder
    # and as its weights alone in one file: the loader infers the config from the shapes.
    from diffusers import ControlNetModel
    g32 = ControlNetModel.from_config(dict(nets["cn-sd-a"].config), norm_num_groups=32).eval()
    g32.load_state_dict(nets["cn-sd-a"].state_dict())
    g32.save_pretrained(os.path.join(args.out, "cn-sd-g32"))
    save_file({k: v.contiguous() for k, v in g32.state_dict().items()}, os.path.join(args.out, "cn-sd-g32.safetensors"))
    ldm_net = write_ldm_controlnet(g32, args.out)
    g = torch.Generator().manual_seed(96)
    inputs = {"sample": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([700.0, 300.0]),
              "encoder_hidden_states": torch.randn(2, 7, 32, generator=g),
              "cond": torch.rand(2, 3, 64, 64, generator=g)}
    down, mid = ldm_net(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"], inputs["cond"],
                        conditioning_scale=0.7, return_dict=False)
    assert mid.abs().max() > 1e-3
    ldm_case = dict(inputs, mid=mid)
    ldm_case.update({f"down.{i}": d for i, d in enumerate(down)})
    save_file({k: v.contiguous() for k, v in ldm_case.items()}, os.path.join(args.out, "controlnet_ldm_case.safetensors"))

    edges = Image.new("RGB", (50, 40), 0)
    d = ImageDraw.Draw(edges)
    d.rectangle((8, 6, 40, 32), outline=(255, 255, 255), width=2)
    d.line((0, 39, 49, 0), fill=(255, 255, 255), width=1)
    edges.save(os.path.join(args.out, "edges.png"))
    blobs = Image.new("RGB", (64, 64), (30, 30, 30))
    ImageDraw.Draw(blobs).ellipse((10, 12, 50, 44), fill=(200, 120, 40))
    blobs.save(os.path.join(args.out, "blobs.png"))
    images = {"edges.png": edges, "blobs.png": blobs}

    common = dict(prompt="a red apple", negative_prompt="blurry", num_inference_steps=4, guidance_scale=7.5,
                  height=64, width=64, output_type="np")
    cases, tensors = [], {}

    def run(name, base, controls, seed):
        sched = EulerDiscreteScheduler.from_config(base.scheduler.config)
        parts = {k: v for k, v in base.components.items()}
        parts["scheduler"] = sched
        multi = len(controls) > 1
        net = [nets[c["net"]] for c in controls] if multi else nets[controls[0]["net"]]
        cls = StableDiffusionXLControlNetPipeline if base is xl else StableDiffusionControlNetPipeline
        if cls is StableDiffusionControlNetPipeline:
            parts.pop("image_encoder", None)
            pipe = cls(**parts, controlnet=net)
        else:
            parts.pop("image_encoder", None)
            parts.pop("feature_extractor", None)
            pipe = cls(**parts, controlnet=net)
        pipe.set_progress_bar_config(disable=True)
        image = [images[c["image"]] for c in controls]
        pick = (lambda k: [c[k] for c in controls]) if multi else (lambda k: controls[0][k])
        out = pipe(image=image if multi else image[0], controlnet_conditioning_scale=pick("scale"),
                   control_guidance_start=pick("start"), control_guidance_end=pick("end"),
                   generator=torch.Generator().manual_seed(seed), **common).images
        tensors[name] = torch.from_numpy(out).contiguous()
        cases.append({"name": name, "model": "tiny-sdxl" if base is xl else "tiny-sd", "seed": seed,
                      "prompt": common["prompt"], "negative_prompt": common["negative_prompt"], "steps": 4,
                      "cfg": 7.5, "width": 64, "height": 64, "sampler": "euler", "controlnets": controls})

    c = lambda net, image, scale=1.0, start=0.0, end=1.0: {"net": net, "image": image, "scale": scale,
                                                            "start": start, "end": end}
    run("sd.one", sd, [c("cn-sd-a", "edges.png", 0.8)], 101)
    run("sd.window", sd, [c("cn-sd-a", "edges.png", 1.0, 0.25, 0.75)], 102)
    run("sd.two", sd, [c("cn-sd-a", "edges.png", 0.6), c("cn-sd-b", "blobs.png", 0.5, 0.0, 0.5)], 103)
    run("xl.one", xl, [c("cn-sdxl", "blobs.png", 0.9)], 104)
    # The control must change the image, or the cases prove nothing.
    plain = sd(generator=torch.Generator().manual_seed(101), **common).images
    assert abs(torch.from_numpy(plain) - tensors["sd.one"]).max() > 0.05, "the ControlNet changes nothing"
    save_file(tensors, os.path.join(args.out, "controlnet_cases.safetensors"))
    with open(os.path.join(args.out, "controlnet_cases.json"), "w") as f:
        json.dump(cases, f)


if __name__ == "__main__":
    main()
