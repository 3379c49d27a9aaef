#!/usr/bin/env python3
"""Reference oracle for LoRA: tiny seeded LoRAs for make_fixtures.py's tiny-sd / tiny-sdxl
(--fixtures), saved in diffusers' PEFT layout (save_lora_weights, with its adapter metadata) and
in kohya's (lora_unet_ / lora_te_ names, .alpha; SDXL's UNet under its original input_blocks names),
and diffusers' images with them loaded (load_lora_weights + set_adapters). Both layouts of a LoRA
must give diffusers the same image: that checks the kohya files written here against diffusers' own
converter. LoHa and LoKr layers: PEFT's get_delta_weight on seeded layers.

Writes into --out: *.safetensors (the LoRAs; broken ones for the error paths), lora_cases.json,
lora_cases.safetensors (images, float HWC; the LyCORIS layers' tensors and deltas). CPU, seconds.
"""
import argparse
import json
import os
import re

import torch
from safetensors.torch import save_file

torch.set_grad_enabled(False)
RANK, ALPHA = 4, 8.0
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1",
                "conv2"]
TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)


def ldm_names(unet):
    """diffusers module name -> the original UNet's (input_blocks / middle_block / output_blocks),
    for UNets of one layers_per_block."""
    layers = unet.config.layers_per_block
    resnet = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
              "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
    out = {}
    for name, _ in unet.named_modules():
        m = re.match(r"(down_blocks|up_blocks|mid_block)\.(?:(\d+)\.)?(resnets|attentions)\.(\d+)\.(.+)", name)
        if not m:
            continue
        where, b, kind, i, rest = m[1], int(m[2] or 0), m[3], int(m[4]), m[5]
        if kind == "resnets":
            head, _, tail = rest.partition(".")
            if head not in resnet:
                continue
            rest = resnet[head] + ("." + tail if tail else "")
        if where == "down_blocks":
            block = f"input_blocks.{1 + b * (layers + 1) + i}.{0 if kind == 'resnets' else 1}"
        elif where == "up_blocks":
            block = f"output_blocks.{b * (layers + 1) + i}.{0 if kind == 'resnets' else 1}"
        else:
            block = f"middle_block.{(0 if i == 0 else 2) if kind == 'resnets' else 1}"
        out[name] = block + "." + rest
    return out


def kohya(state, component, prefix, unet=None):
    """PEFT's lora_A / lora_B state dict of one component -> kohya's names."""
    names = ldm_names(unet) if unet is not None else {}
    out = {}
    for key, t in state.items():
        module, _, role = key.rpartition(".lora_")
        role = role.split(".")[0]
        name = names.get(module, module)
        if component.startswith("te") and not name.startswith("text_model."):
            name = "text_model." + name  # kohya's names are transformers 4's (text_model.encoder.layers...)
        base = prefix + name.replace(".", "_")
        out[f"{base}.lora_{'down' if role == 'A' else 'up'}.weight"] = t
        out[f"{base}.alpha"] = torch.tensor(ALPHA)
    return out


SD3_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
               "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]


def make_sd3_lora(pipe, name, seed, out):
    """A LoRA for SD3's transformer and both CLIP encoders, saved by diffusers (transformer. keys)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from diffusers import StableDiffusion3Pipeline

    pipe.transformer.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=SD3_TARGETS,
                                            init_lora_weights=False), adapter_name="x")
    cfg_t = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TE_TARGETS, init_lora_weights=False)
    pipe.text_encoder.add_adapter(cfg_t, adapter_name="x")
    pipe.text_encoder_2.add_adapter(cfg_t, adapter_name="x")
    models = (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2)
    for i, m in enumerate(models):
        randomise(m, seed + i)
    layers = [get_peft_model_state_dict(m, adapter_name="x") for m in models]
    d = os.path.join(out, f"{name}-peft")
    meta = {"r": RANK, "lora_alpha": ALPHA, "target_modules": SD3_TARGETS}
    meta_t = {"r": RANK, "lora_alpha": ALPHA, "target_modules": TE_TARGETS}
    StableDiffusion3Pipeline.save_lora_weights(d, transformer_lora_layers=layers[0], text_encoder_lora_layers=layers[1],
                                               text_encoder_2_lora_layers=layers[2], transformer_lora_adapter_metadata=meta,
                                               text_encoder_lora_adapter_metadata=meta_t,
                                               text_encoder_2_lora_adapter_metadata=meta_t)
    os.replace(os.path.join(d, "pytorch_lora_weights.safetensors"), os.path.join(out, f"{name}-peft.safetensors"))
    os.rmdir(d)
    pipe.transformer.delete_adapters("x")
    pipe.text_encoder.delete_adapter("x")
    pipe.text_encoder_2.delete_adapter("x")


def make_loras(pipe, name, seed, out, xl, metadata=None):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    cfg_u = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=UNET_TARGETS, init_lora_weights=False)
    cfg_t = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TE_TARGETS, init_lora_weights=False)
    pipe.unet.add_adapter(cfg_u, adapter_name="x")
    pipe.text_encoder.add_adapter(cfg_t, adapter_name="x")
    if xl:
        pipe.text_encoder_2.add_adapter(cfg_t, adapter_name="x")
    randomise(pipe.unet, seed)
    randomise(pipe.text_encoder, seed + 1)
    if xl:
        randomise(pipe.text_encoder_2, seed + 2)
    su = get_peft_model_state_dict(pipe.unet, adapter_name="x")
    st = get_peft_model_state_dict(pipe.text_encoder, adapter_name="x")
    st2 = get_peft_model_state_dict(pipe.text_encoder_2, adapter_name="x") if xl else None
    meta = {"r": RANK, "lora_alpha": ALPHA, "target_modules": UNET_TARGETS}
    meta_t = {"r": RANK, "lora_alpha": ALPHA, "target_modules": TE_TARGETS}
    peft_dir = os.path.join(out, f"{name}-peft")
    kw = dict(unet_lora_layers=su, text_encoder_lora_layers=st, unet_lora_adapter_metadata=meta,
              text_encoder_lora_adapter_metadata=meta_t)
    if xl:
        StableDiffusionXLPipeline.save_lora_weights(peft_dir, text_encoder_2_lora_layers=st2,
                                                    text_encoder_2_lora_adapter_metadata=meta_t, **kw)
    else:
        StableDiffusionPipeline.save_lora_weights(peft_dir, **kw)
    os.replace(os.path.join(peft_dir, "pytorch_lora_weights.safetensors"), os.path.join(out, f"{name}-peft.safetensors"))
    os.rmdir(peft_dir)
    k = kohya(su, "unet", "lora_unet_", unet=pipe.unet if xl else None)
    k.update(kohya(st, "te", "lora_te1_" if xl else "lora_te_"))
    if xl:
        k.update(kohya(st2, "te2", "lora_te2_"))
    save_file({a: b.contiguous() for a, b in k.items()}, os.path.join(out, f"{name}-kohya.safetensors"), metadata=metadata)
    pipe.unet.delete_adapters("x")
    pipe.text_encoder.delete_adapter("x")
    if xl:
        pipe.text_encoder_2.delete_adapter("x")
    return k


def image(pipe, prompt, seed, loras, cfg=7.5):
    pipe.unload_lora_weights()
    names, weights = [], []
    for i, (path, w) in enumerate(loras):
        pipe.load_lora_weights(path, adapter_name=f"l{i}")
        names.append(f"l{i}")
        weights.append(w)
    if names:
        pipe.set_adapters(names, weights)
        # Into the weights, as Diffract patches them: the unfused forward (x W + s B A x) rounds
        # otherwise, which these random LoRAs' large updates amplify into visible differences.
        pipe.fuse_lora(adapter_names=names)
    img = pipe(prompt, negative_prompt="blurry", num_inference_steps=4, guidance_scale=cfg, height=64, width=64,
               output_type="np", generator=torch.Generator().manual_seed(seed)).images
    if names:
        pipe.unfuse_lora()
    pipe.unload_lora_weights()
    return torch.from_numpy(img)


def lycoris_layers(tensors):
    """LoHa and LoKr on a Linear and a Conv2d through PEFT: the layer's tensors in LyCORIS names, and the delta."""
    from peft import LoHaConfig, LoKrConfig, inject_adapter_in_model

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(12, 20)
            self.conv = torch.nn.Conv2d(6, 8, 3)

    cases = []
    for kind, cfg in (("loha", LoHaConfig(r=3, alpha=5.0, target_modules=["lin", "conv"], init_weights=False)),
                      ("lokr", LoKrConfig(r=2, alpha=3.0, target_modules=["lin", "conv"], init_weights=False,
                                          decompose_both=True, decompose_factor=-1))):
        torch.manual_seed(9)
        net = inject_adapter_in_model(cfg, Net())
        randomise(net, 11)
        for layer in ("lin", "conv"):
            mod = getattr(net, layer)
            key = f"{kind}.{layer}"
            for pname, p in mod.named_parameters():
                if pname.startswith(("hada_", "lokr_")):
                    lyco = pname.split(".")[0]
                    tensors[f"{key}.{lyco}"] = p.detach().clone().contiguous()
            tensors[f"{key}.delta"] = mod.get_delta_weight("default").contiguous()
            tensors[f"{key}.weight_shape"] = torch.tensor(list(mod.base_layer.weight.shape))
            cases.append({"name": key, "alpha": cfg.alpha, "peft_scale": mod.scaling["default"]})
    return cases


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from diffusers import (EulerDiscreteScheduler, StableDiffusion3Pipeline, StableDiffusionPipeline,
                           StableDiffusionXLPipeline)

    sd3 = StableDiffusion3Pipeline.from_pretrained(os.path.join(args.fixtures, "sd3_pipeline", "tiny-sd3"),
                                                   text_encoder_3=None, tokenizer_3=None)
    sd3.set_progress_bar_config(disable=True)
    sd = StableDiffusionPipeline.from_pretrained(os.path.join(args.fixtures, "tiny-sd"))
    xl = StableDiffusionXLPipeline.from_pretrained(os.path.join(args.fixtures, "tiny-sdxl"))
    for p in (sd, xl):
        p.scheduler = EulerDiscreteScheduler.from_config(p.scheduler.config)
        p.set_progress_bar_config(disable=True)
    make_loras(sd, "sd-a", 41, args.out, False)
    # As kohya's trainer writes them: the tags of its captions per dataset folder, the base model.
    tags = {"10_brandx": {"brandx": 12, " red bottle": 5, "studio": 7}, "5_extra": {"studio": 1}}
    make_loras(sd, "sd-b", 51, args.out, False,
               metadata={"ss_tag_frequency": json.dumps(tags), "ss_base_model_version": "sd_v1"})
    xl_kohya = make_loras(xl, "xl-a", 61, args.out, True)
    make_sd3_lora(sd3, "sd3-a", 81, args.out)
    f = lambda n: os.path.join(args.out, n + ".safetensors")
    tensors, cases = {}, []
    for name, pipe, model, loras in (
            ("sd.none", sd, "tiny-sd", []),
            ("sd.peft", sd, "tiny-sd", [("sd-a-peft", 1.0)]),
            ("sd.kohya", sd, "tiny-sd", [("sd-a-kohya", 1.0)]),
            ("sd.two", sd, "tiny-sd", [("sd-a-peft", 0.7), ("sd-b-kohya", -0.4)]),
            ("xl.peft", xl, "tiny-sdxl", [("xl-a-peft", 0.8)]),
            ("xl.kohya", xl, "tiny-sdxl", [("xl-a-kohya", 0.8)]),
            ("sd3.none", sd3, "sd3_pipeline/tiny-sd3", []),
            ("sd3.peft", sd3, "sd3_pipeline/tiny-sd3", [("sd3-a-peft", 0.9)])):
        sd3_case = pipe is sd3
        img = image(pipe, "a red apple", 71, [(f(n), w) for n, w in loras], cfg=5.0 if sd3_case else 7.5)
        tensors[name + ".image"] = img.contiguous()
        cases.append({"name": name, "model": model, "prompt": "a red apple", "negative_prompt": "blurry", "seed": 71,
                      "steps": 4, "cfg": 5.0 if sd3_case else 7.5, "width": 64, "height": 64,
                      "sampler": "flow-euler" if sd3_case else "euler",
                      "loras": [{"file": n + ".safetensors", "weight": w} for n, w in loras]})
    by = {c["name"]: tensors[c["name"] + ".image"] for c in cases}
    for a, b in (("sd.peft", "sd.kohya"), ("xl.peft", "xl.kohya")):
        d = (by[a] - by[b]).abs().max()
        assert d < 1e-4, f"{a} vs {b}: diffusers reads the kohya file otherwise ({d})"
    assert (by["sd.peft"] - by["sd.none"]).abs().max() > 0.05, "the LoRA changes nothing"
    assert (by["sd3.peft"] - by["sd3.none"]).abs().max() > 0.05, "the SD3 LoRA changes nothing"
    assert any(k.startswith("lora_unet_input_blocks_") for k in xl_kohya), "SDXL's kohya names are the original ones"
    # Broken files for the error paths.
    full = dict(xl_kohya)
    save_file({k: v.contiguous() for k, v in full.items()}, f("xl-for-sd"))  # SDXL's LoRA: shapes do not fit SD
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4, 3, 3)}, f("checkpoint"))
    save_file({"foo.weight": torch.zeros(2, 2)}, f("not-lora"))
    sd_a = {k: v for k, v in __import__("safetensors.torch", fromlist=["load_file"]).load_file(f("sd-a-kohya")).items()}
    sd_a["lora_unet_down_blocks_9_attentions_0_proj_in.lora_down.weight"] = torch.zeros(RANK, 32)
    sd_a["lora_unet_down_blocks_9_attentions_0_proj_in.lora_up.weight"] = torch.zeros(32, RANK)
    save_file(sd_a, f("sd-extra-layer"))  # one layer naming a module the model lacks
    # A1111's "addnet" hash (Civitai's AutoV3): SHA-256 of the bytes after the header.
    import hashlib
    hashes = {}
    for n in ("sd-a-kohya", "sd-a-peft"):
        with open(f(n), "rb") as fh:
            header = int.from_bytes(fh.read(8), "little")
            fh.seek(8 + header)
            hashes[n] = hashlib.sha256(fh.read()).hexdigest()
    lyco = lycoris_layers(tensors)
    save_file(tensors, os.path.join(args.out, "lora_cases.safetensors"))
    with open(os.path.join(args.out, "lora_cases.json"), "w") as fh:
        json.dump({"images": cases, "lycoris": lyco, "hashes": hashes}, fh)


if __name__ == "__main__":
    main()
