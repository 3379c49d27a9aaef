#!/usr/bin/env python3
"""Reference oracle for single-file checkpoints (the original SD / SGM key layout).

Converts the tiny diffusers folders that make_fixtures.py wrote (tiny-sd, tiny-sdxl) and a tiny
SD 2.x-style model made here (tiny-sd2: OpenCLIP-style gelu text encoder, linear projections)
into single .safetensors files in the ORIGINAL layouts, with this script's own inverse mapping:

  model.diffusion_model.*   LDM / SGM UNet (input_blocks / middle_block / output_blocks, ...)
  first_stage_model.*       LDM VAE (encoder.down.N.block.M, mid.attn_1.q as 1x1 convs, ...)
  cond_stage_model.transformer.text_model.*   SD 1.x CLIP-L (HF layout)
  cond_stage_model.model.*                    SD 2.x OpenCLIP (resblocks, in_proj, ...)
  conditioner.embedders.{0,1}.*               SDXL CLIP-L (HF layout) and OpenCLIP-bigG

Independent check: each file is loaded back with diffusers' from_single_file(path, config=<tiny
folder>) and every component's state dict must equal the folder's (torch.equal), or this script
fails (tiny-sdxl's text_encoder_2 through the same diffusers conversion function, see
check_with_diffusers). It also writes header-only stand-ins of the real-size SD 1.5 / SD 2.1 / SDXL layouts
(name -> shape JSON, made from diffusers / transformers models on the meta device) and a few
bad inputs for the loader's error paths. Everything goes into --out; CPU only, seconds.
"""
import argparse
import json
import os
import re
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from safetensors.torch import load_file, save_file

torch.set_grad_enabled(False)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=0)


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# --- diffusers -> original layout ---------------------------------------------------------------
RESNET_TO_LDM = [("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("time_emb_proj", "emb_layers.1"),
                 ("norm2", "out_layers.0"), ("conv2", "out_layers.3"), ("conv_shortcut", "skip_connection")]


def per_block(value, n):
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def unet_to_ldm(sd, config):
    """diffusers UNet2DConditionModel keys -> LDM / SGM keys (without the model.diffusion_model. prefix)."""
    n = len(config["block_out_channels"])
    layers = per_block(config["layers_per_block"], n)
    out = {}

    def put(ldm, tensor):
        assert ldm not in out, ldm
        out[ldm] = tensor

    renames = {}  # diffusers module prefix -> LDM module prefix
    idx = 1
    for b in range(n):
        for l in range(layers[b]):
            renames[f"down_blocks.{b}.resnets.{l}."] = (f"input_blocks.{idx}.0.", True)
            renames[f"down_blocks.{b}.attentions.{l}."] = (f"input_blocks.{idx}.1.", False)
            idx += 1
        if b + 1 < n:
            renames[f"down_blocks.{b}.downsamplers.0.conv."] = (f"input_blocks.{idx}.0.op.", False)
            idx += 1
    renames["mid_block.resnets.0."] = ("middle_block.0.", True)
    renames["mid_block.attentions.0."] = ("middle_block.1.", False)
    renames["mid_block.resnets.1."] = ("middle_block.2.", True)
    k = 0
    for b in range(n):
        count = layers[n - 1 - b] + 1
        has_attn = any(key.startswith(f"up_blocks.{b}.attentions.") for key in sd)
        for l in range(count):
            renames[f"up_blocks.{b}.resnets.{l}."] = (f"output_blocks.{k}.0.", True)
            renames[f"up_blocks.{b}.attentions.{l}."] = (f"output_blocks.{k}.1.", False)
            if l == count - 1 and b + 1 < n:
                renames[f"up_blocks.{b}.upsamplers.0.conv."] = (f"output_blocks.{k}.{2 if has_attn else 1}.conv.", False)
            k += 1
    for name, ldm in (("conv_in.", "input_blocks.0.0."), ("time_embedding.linear_1.", "time_embed.0."),
                      ("time_embedding.linear_2.", "time_embed.2."), ("add_embedding.linear_1.", "label_emb.0.0."),
                      ("add_embedding.linear_2.", "label_emb.0.2."), ("conv_norm_out.", "out.0."),
                      ("conv_out.", "out.2.")):
        renames[name] = (ldm, False)

    for key, tensor in sd.items():
        for prefix, (ldm, resnet) in renames.items():
            if key.startswith(prefix):
                rest = key[len(prefix):]
                if resnet:
                    for a, b in RESNET_TO_LDM:
                        if rest.startswith(a + "."):
                            rest = b + rest[len(a):]
                            break
                    else:
                        raise KeyError(key)
                put(ldm + rest, tensor)
                break
        else:
            raise KeyError(f"unmapped UNet key {key}")
    return out


def vae_to_ldm(sd, config):
    """diffusers AutoencoderKL keys -> LDM keys (without the first_stage_model. prefix)."""
    n = len(config["block_out_channels"])
    out = {}
    for key, tensor in sd.items():
        k = key
        m = re.match(r"encoder\.down_blocks\.(\d+)\.(resnets|downsamplers)\.(\d+)\.(.*)", k)
        if m:
            i, kind, j, rest = m.groups()
            k = f"encoder.down.{i}.block.{j}.{rest}" if kind == "resnets" else f"encoder.down.{i}.downsample.{rest}"
        m = re.match(r"decoder\.up_blocks\.(\d+)\.(resnets|upsamplers)\.(\d+)\.(.*)", k)
        if m:
            i, kind, j, rest = m.groups()
            i = n - 1 - int(i)
            k = f"decoder.up.{i}.block.{j}.{rest}" if kind == "resnets" else f"decoder.up.{i}.upsample.{rest}"
        m = re.match(r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.*)", k)
        if m:
            part, j, rest = m.groups()
            k = f"{part}.mid.block_{int(j) + 1}.{rest}"
        m = re.match(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.*)", k)
        if m:
            part, rest = m.groups()
            rest = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}[
                rest.rsplit(".", 1)[0]] + "." + rest.rsplit(".", 1)[1]
            k = f"{part}.mid.attn_1.{rest}"
            if tensor.dim() == 2:  # linear -> 1x1 conv, as the original AttnBlock holds them
                tensor = tensor[:, :, None, None]
        k = k.replace(".conv_shortcut.", ".nin_shortcut.")
        k = re.sub(r"^(encoder|decoder)\.conv_norm_out\.", r"\1.norm_out.", k)
        assert k not in out, k
        out[k] = tensor
    return out


def hf_clip_keys(sd):
    """transformers 5 saves CLIPTextModel without text_model.; SD files always have it."""
    return {(k if k.startswith(("text_model.", "text_projection")) else "text_model." + k): v for k, v in sd.items()}


def clip_to_open_clip(sd, extra_layer=None, projection=None):
    """transformers CLIP text keys -> OpenCLIP keys (without the ...model. prefix)."""
    sd = hf_clip_keys(sd)
    out = {}
    layers = sorted({int(m.group(1)) for k in sd for m in [re.match(r"text_model\.encoder\.layers\.(\d+)\.", k)] if m})
    for i in layers:
        p = f"text_model.encoder.layers.{i}."
        r = f"transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[r + f"attn.in_proj_{kind}"] = torch.cat([sd[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv"], 0)
            out[r + f"attn.out_proj.{kind}"] = sd[p + f"self_attn.out_proj.{kind}"]
            out[r + f"ln_1.{kind}"] = sd[p + f"layer_norm1.{kind}"]
            out[r + f"ln_2.{kind}"] = sd[p + f"layer_norm2.{kind}"]
            out[r + f"mlp.c_fc.{kind}"] = sd[p + f"mlp.fc1.{kind}"]
            out[r + f"mlp.c_proj.{kind}"] = sd[p + f"mlp.fc2.{kind}"]
    if extra_layer is not None:  # the layer SD 2.x never uses (it takes the penultimate output)
        i = len(layers)
        for name, t in extra_layer.items():
            out[f"transformer.resblocks.{i}.{name}"] = t
    out["token_embedding.weight"] = sd["text_model.embeddings.token_embedding.weight"]
    out["positional_embedding"] = sd["text_model.embeddings.position_embedding.weight"]
    out["ln_final.weight"] = sd["text_model.final_layer_norm.weight"]
    out["ln_final.bias"] = sd["text_model.final_layer_norm.bias"]
    if "text_projection.weight" in sd:
        out["text_projection"] = sd["text_projection.weight"].t().contiguous()
    elif projection is not None:
        out["text_projection"] = projection
    out["logit_scale"] = torch.tensor(4.6052)
    return out


def random_open_clip_layer(width, inner, g):
    r = lambda *s: torch.randn(*s, generator=g) * 0.02
    return {"attn.in_proj_weight": r(3 * width, width), "attn.in_proj_bias": r(3 * width),
            "attn.out_proj.weight": r(width, width), "attn.out_proj.bias": r(width),
            "ln_1.weight": torch.ones(width), "ln_1.bias": torch.zeros(width),
            "ln_2.weight": torch.ones(width), "ln_2.bias": torch.zeros(width),
            "mlp.c_fc.weight": r(inner, width), "mlp.c_fc.bias": r(inner),
            "mlp.c_proj.weight": r(width, inner), "mlp.c_proj.bias": r(width)}


def schedule_buffers():
    """Buffers of the original LatentDiffusion wrapper that single files carry at the top level."""
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    alphas_cumprod = torch.cumprod(1 - betas, 0)
    return {"betas": betas.float(), "alphas_cumprod": alphas_cumprod.float(),
            "alphas_cumprod_prev": torch.cat([torch.ones(1), alphas_cumprod[:-1].float()])}


def component(folder, name):
    d = os.path.join(folder, name)
    for f in ("diffusion_pytorch_model.safetensors", "model.safetensors"):
        if os.path.exists(os.path.join(d, f)):
            return load_file(os.path.join(d, f)), read_json(os.path.join(d, "config.json"))
    raise FileNotFoundError(d)


def position_ids(n):
    return torch.arange(n, dtype=torch.int64)[None]


def single_file(folder, family, g):
    unet, unet_cfg = component(folder, "unet")
    vae, vae_cfg = component(folder, "vae")
    te, _ = component(folder, "text_encoder")
    ckpt = dict(schedule_buffers())
    ckpt.update({"model.diffusion_model." + k: v for k, v in unet_to_ldm(unet, unet_cfg).items()})
    ckpt.update({"first_stage_model." + k: v for k, v in vae_to_ldm(vae, vae_cfg).items()})
    if family == "sd1":
        te = hf_clip_keys(te)
        te["text_model.embeddings.position_ids"] = position_ids(te["text_model.embeddings.position_embedding.weight"].shape[0])
        ckpt.update({"cond_stage_model.transformer." + k: v for k, v in te.items()})
    elif family == "sd2":
        _, te_cfg = component(folder, "text_encoder")
        width, inner = te_cfg["hidden_size"], te_cfg["intermediate_size"]
        oc = clip_to_open_clip(te, extra_layer=random_open_clip_layer(width, inner, g),
                               projection=torch.randn(width, width, generator=g))
        ckpt.update({"cond_stage_model.model." + k: v for k, v in oc.items()})
    else:
        te = hf_clip_keys(te)
        te["text_model.embeddings.position_ids"] = position_ids(te["text_model.embeddings.position_embedding.weight"].shape[0])
        ckpt.update({"conditioner.embedders.0.transformer." + k: v for k, v in te.items()})
        te2, _ = component(folder, "text_encoder_2")
        ckpt.update({"conditioner.embedders.1.model." + k: v for k, v in clip_to_open_clip(te2).items()})
    return {k: v.contiguous() for k, v in ckpt.items()}


# --- a tiny SD 2.x-style diffusers model ----------------------------------------------------------
def make_tiny_sd2(fixtures, out):
    from diffusers import (AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel)
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(7)
    cfg = CLIPTextConfig(vocab_size=49408, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                         num_attention_heads=4, max_position_embeddings=77, hidden_act="gelu", projection_dim=32,
                         bos_token_id=49406, eos_token_id=2, pad_token_id=1, layer_norm_eps=1e-5)
    te = CLIPTextModel(cfg).eval()
    torch.manual_seed(8)
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=1, sample_size=16, in_channels=4,
                                out_channels=4, down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=(2, 4), use_linear_projection=True, norm_num_groups=8)
    vae = AutoencoderKL.from_pretrained(os.path.join(fixtures, "tiny-sd", "vae"))
    tok = CLIPTokenizer.from_pretrained(os.path.join(fixtures, "tokenizer_g"))  # pads with "!" as SD 2.x does
    sched = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                   timestep_spacing="leading", steps_offset=1, prediction_type="v_prediction")
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=tok, unet=unet, scheduler=sched,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    path = os.path.join(out, "tiny-sd2")
    pipe.save_pretrained(path)
    return path


# --- independent check through diffusers -------------------------------------------------------------
def check_with_diffusers(path, folder, family):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    cls = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
    pipe = cls.from_single_file(path, config=folder, local_files_only=True)
    names = ["unet", "vae", "text_encoder"] + (["text_encoder_2"] if family == "sdxl" else [])
    models = {name: getattr(pipe, name) for name in names}
    if family == "sdxl":
        # diffusers picks text_encoder_2's conversion by width: when embedders.0's position embedding is as
        # wide as text_encoder_2 it converts embedders.0 (CLIP-L) instead. Real SDXL (768 vs 1280) never
        # meets that; the tiny one (32 and 32) does. So text_encoder_2 goes through the same diffusers
        # function from_single_file uses, on the file without embedders.0.
        from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm
        from transformers import CLIPTextModelWithProjection

        ckpt = {k: v for k, v in load_file(path).items() if not k.startswith("conditioner.embedders.0.")}
        models["text_encoder_2"] = create_diffusers_clip_model_from_ldm(
            CLIPTextModelWithProjection, ckpt, config=folder, subfolder="text_encoder_2", local_files_only=True)
    for name in names:
        expected, _ = component(folder, name)
        got = models[name].state_dict()
        if name.startswith("text_encoder"):
            expected, got = hf_clip_keys(expected), hf_clip_keys(got)
        if set(got) != set(expected):
            sys.exit(f"{path}: {name}: keys differ from {folder}: only in single file "
                     f"{sorted(set(got) - set(expected))[:5]}, only in folder {sorted(set(expected) - set(got))[:5]}")
        bad = [k for k in expected if not torch.equal(got[k], expected[k])]
        if bad:
            sys.exit(f"{path}: {name}: {len(bad)} tensors differ from {folder}, e.g. {bad[:5]}")
        print(f"{os.path.basename(path)}: {name}: {len(expected)} tensors equal to the folder's")


# --- real-size layouts as names and shapes only -------------------------------------------------------
def real_layouts(out):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    sd15 = dict(block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, cross_attention_dim=768,
                attention_head_dim=8, down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, sample_size=64)
    sd21 = dict(sd15, cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20), use_linear_projection=True,
                sample_size=96)
    sdxl = dict(block_out_channels=(320, 640, 1280), layers_per_block=2, cross_attention_dim=2048,
                attention_head_dim=(5, 10, 20), use_linear_projection=True, sample_size=128,
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                transformer_layers_per_block=(1, 2, 10), addition_embed_type="text_time", addition_time_embed_dim=256,
                projection_class_embeddings_input_dim=2816)
    vae_cfg = dict(block_out_channels=(128, 256, 512, 512), latent_channels=4, layers_per_block=2,
                   down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
    clip = lambda hidden, inner, layers, act, proj: CLIPTextConfig(
        vocab_size=49408, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, max_position_embeddings=77, hidden_act=act, projection_dim=proj)

    def shapes(sd):
        return {k: list(v.shape) for k, v in sd.items()}

    # OpenCLIP-H's 24th resblock, which SD 2.x files carry and never use (23 layers in diffusers).
    resblock_23 = {"attn.in_proj_weight": (3072, 1024), "attn.in_proj_bias": (3072,),
                   "attn.out_proj.weight": (1024, 1024), "attn.out_proj.bias": (1024,),
                   "ln_1.weight": (1024,), "ln_1.bias": (1024,), "ln_2.weight": (1024,), "ln_2.bias": (1024,),
                   "mlp.c_fc.weight": (4096, 1024), "mlp.c_fc.bias": (4096,),
                   "mlp.c_proj.weight": (1024, 4096), "mlp.c_proj.bias": (1024,)}
    with torch.device("meta"):
        vae = AutoencoderKL(**vae_cfg).state_dict()
        clip_l = hf_clip_keys(CLIPTextModel(clip(768, 3072, 12, "quick_gelu", 768)).state_dict())
        layouts = {}
        for name, cfg in (("sd15", sd15), ("sd21", sd21), ("sdxl", sdxl)):
            unet = UNet2DConditionModel(**cfg).state_dict()
            expected = {"unet": shapes(unet), "vae": shapes(vae)}
            ckpt = {"model.diffusion_model." + k: v for k, v in unet_to_ldm(unet, cfg).items()}
            ckpt.update({"first_stage_model." + k: v for k, v in vae_to_ldm(vae, vae_cfg).items()})
            ckpt.update({k: torch.empty(1000) for k in schedule_buffers()})
            if name == "sd15":
                expected["text_encoder"] = shapes(clip_l)
                ckpt.update({"cond_stage_model.transformer." + k: v for k, v in clip_l.items()})
                ckpt["cond_stage_model.transformer.text_model.embeddings.position_ids"] = torch.empty(1, 77, dtype=torch.int64)
            elif name == "sd21":
                h = hf_clip_keys(CLIPTextModel(clip(1024, 4096, 23, "gelu", 1024)).state_dict())
                expected["text_encoder"] = shapes(h)
                oc = clip_to_open_clip(h)
                oc.update({f"transformer.resblocks.23.{k}": torch.empty(v) for k, v in resblock_23.items()})
                oc["text_projection"] = torch.empty(1024, 1024)
                ckpt.update({"cond_stage_model.model." + k: v for k, v in oc.items()})
            else:
                expected["text_encoder"] = shapes(clip_l)
                ckpt.update({"conditioner.embedders.0.transformer." + k: v for k, v in clip_l.items()})
                ckpt["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"] = torch.empty(
                    1, 77, dtype=torch.int64)
                g = hf_clip_keys(CLIPTextModelWithProjection(clip(1280, 5120, 32, "gelu", 1280)).state_dict())
                expected["text_encoder_2"] = shapes(g)
                ckpt.update({"conditioner.embedders.1.model." + k: v for k, v in clip_to_open_clip(g).items()})
            layouts[name] = {"checkpoint": shapes(ckpt), "expected": expected}
    for name, layout in layouts.items():
        write_json(os.path.join(out, f"layout_{name}.json"), layout)
        print(f"layout_{name}.json: {len(layout['checkpoint'])} tensors")


# --- inputs the loader must reject ------------------------------------------------------------------
def bad_inputs(out, sd1):
    g = torch.Generator().manual_seed(9)
    r = lambda *s: torch.randn(*s, generator=g)
    save_file({"layer.0.weight": r(4, 4), "layer.0.bias": r(4)}, os.path.join(out, "not_sd.safetensors"))
    save_file({k: v for k, v in sd1.items() if not k.startswith("first_stage_model.")},
              os.path.join(out, "no_vae.safetensors"))
    save_file({k: v for k, v in sd1.items() if k.startswith("model.diffusion_model.")},
              os.path.join(out, "unet_only.safetensors"))
    inpaint = dict(sd1)
    w = inpaint["model.diffusion_model.input_blocks.0.0.weight"]
    inpaint["model.diffusion_model.input_blocks.0.0.weight"] = torch.cat([w, w, w[:, :1]], 1).contiguous()
    save_file(inpaint, os.path.join(out, "inpainting.safetensors"))
    save_file({"model.diffusion_model.joint_blocks.0.context_block.adaLN_modulation.1.bias": r(24),
               "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": r(12, 4),
               "model.diffusion_model.pos_embed": r(1, 16, 4),
               "text_encoders.clip_l.transformer.text_model.embeddings.position_embedding.weight": r(77, 4),
               "first_stage_model.decoder.conv_in.weight": r(8, 16, 3, 3)},
              os.path.join(out, "sd3_like.safetensors"))
    save_file({"double_blocks.0.img_attn.norm.key_norm.scale": r(8), "double_blocks.0.img_attn.qkv.weight": r(24, 8),
               "single_blocks.0.linear1.weight": r(8, 8), "img_in.weight": r(8, 64), "time_in.in_layer.weight": r(8, 256)},
              os.path.join(out, "flux_like.safetensors"))
    with open(os.path.join(out, "garbage.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", required=True, help="where make_fixtures.py wrote tiny-sd and tiny-sdxl")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    g = torch.Generator().manual_seed(6)

    tiny_sd2 = make_tiny_sd2(args.fixtures, args.out)
    cases = (("tiny-sd", os.path.join(args.fixtures, "tiny-sd"), "sd1"),
             ("tiny-sd2", tiny_sd2, "sd2"),
             ("tiny-sdxl", os.path.join(args.fixtures, "tiny-sdxl"), "sdxl"))
    files = {}
    for name, folder, family in cases:
        ckpt = single_file(folder, family, g)
        path = os.path.join(args.out, name + ".safetensors")
        save_file(ckpt, path, metadata={"format": "pt"})
        files[name] = ckpt
        check_with_diffusers(path, folder, family)
    # The same SD 1.x checkpoint as a Lightning-style torch.save file.
    torch.save({"state_dict": files["tiny-sd"], "global_step": 0}, os.path.join(args.out, "tiny-sd.ckpt"))

    real_layouts(args.out)
    bad_inputs(args.out, files["tiny-sd"])
    with open(os.path.join(args.out, "STAMP"), "w") as f:
        f.write("ok\n")


if __name__ == "__main__":
    main()
