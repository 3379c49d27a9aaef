#!/usr/bin/env python3
"""Reference oracle for FLUX.1 single files (Black Forest Labs' and ComfyUI's layouts, float8 ones).

Takes make_flux_fixtures.py's tiny seeded diffusers pipelines (tiny-flux-dev, tiny-flux-schnell) and
writes their models as single files in the original layouts, with this script's own inverse mapping
(diffusers -> BFL):

  tiny-flux-dev-bfl.safetensors      the transformer alone, bare BFL keys (flux1-dev.safetensors):
                                     img_in, txt_in, time_in / vector_in / guidance_in {in,out}_layer,
                                     double_blocks.N.{img,txt}_{mod.lin, attn.qkv (fused), attn.norm.
                                     {query,key}_norm.scale, attn.proj, mlp.0, mlp.2}, single_blocks.N.
                                     {linear1 (q, k, v, MLP in fused), linear2, norm.*_norm.scale,
                                     modulation.lin}, final_layer.{linear, adaLN_modulation.1 as (shift, scale)}
  tiny-flux-schnell-bfl.safetensors  the same for schnell (no guidance_in)
  tiny-flux-dev-aio.safetensors      ComfyUI's all-in-one: model.diffusion_model.* + text_encoders.clip_l.
                                     transformer.* + text_encoders.t5xxl.transformer.* + vae.* (LDM VAE)
  tiny-flux-dev-fp8.safetensors      BFL keys, every 2-D weight float8 e4m3 (no scales), the rest bf16
  tiny-flux-dev-fp8-scaled.safetensors  model.diffusion_model.*, 2-D weights e4m3 with scales: a scalar
                                     `scale_weight` (ComfyUI's scaled_fp8, with the marker and scale_input)
                                     and, for the single blocks' linear1, a per-channel `weight_scale` [out]
  flux-configs/                      only the VAE's and CLIP's config.json and both tokenizers (no weights:
                                     the transformer's and T5's configs are left to shape inference)
  flux_fp8_expected.safetensors      per fp8 file the dequantised transformer in diffusers' keys:
                                     float32(fp8 weight) * scale, and the bf16 tensors as float32
  broken/*.safetensors               files for the loader's error paths

Independent check: diffusers' own convert_flux_transformer_checkpoint_to_diffusers (its source with the
hard-coded `inner_dim = 3072` set to the tiny model's width: the mapping is otherwise untouched) must
give each file back as exactly the folder's transformer tensors (torch.equal); AutoencoderKL.from_single_file
(config=folder, subfolder="vae") the folder's VAE, and diffusers' CLIP and T5 conversions
(convert_ldm_clip_checkpoint, convert_sd3_t5_checkpoint_to_diffusers) its text encoders, or this script
fails. Needs --fixtures (make_flux_fixtures.py's flux/). CPU, seconds.
"""
import argparse
import inspect
import os
import re
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_single_file_fixtures import component, hf_clip_keys, vae_to_ldm  # noqa: E402

torch.set_grad_enabled(False)

# diffusers name inside transformer_blocks.N. -> BFL name inside double_blocks.N.
DOUBLE = [("norm1.linear.", "img_mod.lin."), ("norm1_context.linear.", "txt_mod.lin."),
          ("attn.norm_q.weight", "img_attn.norm.query_norm.scale"), ("attn.norm_k.weight", "img_attn.norm.key_norm.scale"),
          ("attn.norm_added_q.weight", "txt_attn.norm.query_norm.scale"),
          ("attn.norm_added_k.weight", "txt_attn.norm.key_norm.scale"),
          ("attn.to_out.0.", "img_attn.proj."), ("attn.to_add_out.", "txt_attn.proj."),
          ("ff.net.0.proj.", "img_mlp.0."), ("ff.net.2.", "img_mlp.2."),
          ("ff_context.net.0.proj.", "txt_mlp.0."), ("ff_context.net.2.", "txt_mlp.2.")]
SINGLE = [("norm.linear.", "modulation.lin."), ("attn.norm_q.weight", "norm.query_norm.scale"),
          ("attn.norm_k.weight", "norm.key_norm.scale"), ("proj_out.", "linear2.")]
FIXED = [("x_embedder.", "img_in."), ("context_embedder.", "txt_in."),
         ("time_text_embed.timestep_embedder.linear_1.", "time_in.in_layer."),
         ("time_text_embed.timestep_embedder.linear_2.", "time_in.out_layer."),
         ("time_text_embed.text_embedder.linear_1.", "vector_in.in_layer."),
         ("time_text_embed.text_embedder.linear_2.", "vector_in.out_layer."),
         ("time_text_embed.guidance_embedder.linear_1.", "guidance_in.in_layer."),
         ("time_text_embed.guidance_embedder.linear_2.", "guidance_in.out_layer."), ("proj_out.", "final_layer.linear.")]


def shift_scale(t):
    scale, shift = t.chunk(2, 0)
    return torch.cat([shift, scale], 0)


def transformer_to_bfl(sd):
    out, fused = {}, {}

    def put(k, v):
        assert k not in out, k
        out[k] = v.contiguous()

    for key, t in sd.items():
        if key.startswith("norm_out.linear."):
            put("final_layer.adaLN_modulation.1." + key[len("norm_out.linear."):], shift_scale(t))
            continue
        m = re.match(r"transformer_blocks\.(\d+)\.(.*)", key)
        if m:
            b, rest = m.groups()
            mm = re.fullmatch(r"attn\.(to_([qkv])|add_([qkv])_proj)\.(weight|bias)", rest)
            if mm:
                stream = "img" if mm.group(2) else "txt"
                fused.setdefault(f"double_blocks.{b}.{stream}_attn.qkv.{mm.group(4)}", {})[mm.group(2) or mm.group(3)] = t
                continue
            for ours, bfl in DOUBLE:
                if rest.startswith(ours):
                    put(f"double_blocks.{b}.{bfl}{rest[len(ours):]}", t)
                    break
            else:
                raise KeyError(key)
            continue
        m = re.match(r"single_transformer_blocks\.(\d+)\.(.*)", key)
        if m:
            b, rest = m.groups()
            mm = re.fullmatch(r"(attn\.to_([qkv])|proj_mlp)\.(weight|bias)", rest)
            if mm:
                fused.setdefault(f"single_blocks.{b}.linear1.{mm.group(3)}", {})[mm.group(2) or "mlp"] = t
                continue
            for ours, bfl in SINGLE:
                if rest.startswith(ours):
                    put(f"single_blocks.{b}.{bfl}{rest[len(ours):]}", t)
                    break
            else:
                raise KeyError(key)
            continue
        for ours, bfl in FIXED:
            if key.startswith(ours):
                put(bfl + key[len(ours):], t)
                break
        else:
            raise KeyError(key)
    for k, parts in fused.items():
        put(k, torch.cat([parts[n] for n in ("q", "k", "v", "mlp") if n in parts], 0))
    return out


def diffusers_converter(inner_dim):
    """diffusers' convert_flux_transformer_checkpoint_to_diffusers with its width constant set to ours."""
    from diffusers.loaders import single_file_utils

    src = inspect.getsource(single_file_utils.convert_flux_transformer_checkpoint_to_diffusers)
    assert "inner_dim = 3072" in src, "diffusers' converter changed: check the patch below"
    src = src.replace("inner_dim = 3072", f"inner_dim = {inner_dim}")
    scope = dict(vars(single_file_utils))
    exec(compile(src, "convert_flux_transformer_checkpoint_to_diffusers", "exec"), scope)
    return scope["convert_flux_transformer_checkpoint_to_diffusers"]


def check_transformer(ckpt, folder_sd, inner_dim, name, rtol=0.0):
    """diffusers' conversion of `ckpt` against the folder's tensors: equal, or (float8) within rtol of the
    largest magnitude. Returns the conversion."""
    converted = diffusers_converter(inner_dim)(dict(ckpt))
    assert set(converted) == set(folder_sd), (name, set(converted) ^ set(folder_sd))
    for k, v in converted.items():
        if rtol == 0.0:
            assert torch.equal(v, folder_sd[k]), (name, k)
        else:
            want = folder_sd[k].float()
            assert v.shape == want.shape and (v - want).abs().max() <= rtol * want.abs().max(), (name, k)
    return converted


def to_e4m3(t):
    return t.to(torch.float8_e4m3fn)


def fp8_plain(bfl):
    """Every 2-D weight as e4m3, the rest bf16 (as the flux1-dev-fp8 files)."""
    return {k: (to_e4m3(v) if v.dim() == 2 else v.to(torch.bfloat16)) for k, v in bfl.items()}


def fp8_scaled(bfl):
    """2-D weights as e4m3 with scales: per-tensor scale_weight, per-channel weight_scale for linear1."""
    out = {"scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn)}
    for k, v in bfl.items():
        if v.dim() != 2:
            out[k] = v.to(torch.bfloat16)
            continue
        base = k[: -len(".weight")]
        if ".linear1." in k:
            s = v.abs().amax(1) / 448.0
            out[k] = to_e4m3(v / s[:, None])
            out[base + ".weight_scale"] = s.float()
        else:
            s = v.abs().amax() / 448.0
            out[k] = to_e4m3(v / s)
            out[base + ".scale_weight"] = s.float().reshape(1)
            out[base + ".scale_input"] = torch.ones(1)
    return out


def dequantise(ckpt):
    """What a loader must bind: float32(fp8) * scale, other tensors as float32; scale keys gone."""
    out = {}
    for k, v in ckpt.items():
        if k == "scaled_fp8" or k.endswith((".scale_input", ".input_scale", ".scale_weight", ".weight_scale")):
            continue
        w = v.float()
        base = k[: -len(".weight")] if k.endswith(".weight") else None
        if base is not None and base + ".scale_weight" in ckpt:
            w = w * ckpt[base + ".scale_weight"].float().reshape(())
        elif base is not None and base + ".weight_scale" in ckpt:
            w = w * ckpt[base + ".weight_scale"].float().reshape(-1, *([1] * (w.dim() - 1)))
        out[k] = w
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures", required=True, help="make_flux_fixtures.py's output (tiny-flux-dev, tiny-flux-schnell)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(os.path.join(args.out, "broken"), exist_ok=True)
    dev, schnell = (os.path.join(args.fixtures, f"tiny-flux-{n}") for n in ("dev", "schnell"))

    files, expected = {}, {}
    for name, folder in (("dev", dev), ("schnell", schnell)):
        tr, cfg = component(folder, "transformer")
        inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        bfl = transformer_to_bfl(tr)
        check_transformer(bfl, tr, inner, name)
        files[f"tiny-flux-{name}-bfl"] = bfl
        if name == "dev":
            dev_tr, dev_inner, dev_bfl = tr, inner, bfl

    aio = {"model.diffusion_model." + k: v for k, v in dev_bfl.items()}
    vae, vae_cfg = component(dev, "vae")
    aio.update({"vae." + k: v for k, v in vae_to_ldm(vae, vae_cfg).items()})
    clip = hf_clip_keys(component(dev, "text_encoder")[0])
    aio.update({"text_encoders.clip_l.transformer." + k: v for k, v in clip.items()})
    t5 = component(dev, "text_encoder_2")[0]
    aio.update({"text_encoders.t5xxl.transformer." + k: v for k, v in t5.items()})
    check_transformer(aio, dev_tr, dev_inner, "aio")
    files["tiny-flux-dev-aio"] = aio

    fp8 = fp8_plain(dev_bfl)
    scaled = {"model.diffusion_model." + k: v for k, v in fp8_scaled(dev_bfl).items()}
    for name, ckpt in (("fp8", fp8), ("fp8-scaled", scaled)):
        # e4m3 keeps 3 mantissa bits: within 1/16 of each tensor's largest value (unscaled: relative)
        converted = check_transformer(dequantise(ckpt), dev_tr, dev_inner, name, rtol=0.07)
        for k, v in converted.items():
            expected[f"{name}/{k}"] = v
        files[f"tiny-flux-dev-{name}"] = ckpt

    for name, ckpt in files.items():
        save_file({k: v.contiguous() for k, v in ckpt.items()}, os.path.join(args.out, name + ".safetensors"))
    save_file({k: v.contiguous() for k, v in expected.items()}, os.path.join(args.out, "flux_fp8_expected.safetensors"))

    # diffusers reads the all-in-one file's VAE and text encoders back as the folder's.
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_clip_checkpoint, convert_sd3_t5_checkpoint_to_diffusers

    aio_path = os.path.join(args.out, "tiny-flux-dev-aio.safetensors")
    vae_back = AutoencoderKL.from_single_file(aio_path, config=dev, subfolder="vae").state_dict()
    assert set(vae_back) == set(vae), set(vae_back) ^ set(vae)
    assert all(torch.equal(vae_back[k], vae[k]) for k in vae)
    clip_back = convert_ldm_clip_checkpoint(load_file(aio_path), "text_encoders.clip_l.transformer.")
    clip_back = {k: v for k, v in clip_back.items() if not k.endswith("position_ids")}
    assert set(clip_back) == {k for k in clip if not k.endswith("position_ids")}
    assert all(torch.equal(clip_back[k], clip[k]) for k in clip_back)
    t5_back = convert_sd3_t5_checkpoint_to_diffusers(load_file(aio_path))
    for k, v in t5.items():
        assert torch.equal(t5_back[k], v), k

    configs = os.path.join(args.out, "flux-configs")
    shutil.rmtree(configs, ignore_errors=True)
    for name in ("vae", "text_encoder"):
        os.makedirs(os.path.join(configs, name))
        shutil.copy(os.path.join(dev, name, "config.json"), os.path.join(configs, name, "config.json"))
    for name in ("tokenizer", "tokenizer_2"):
        shutil.copytree(os.path.join(dev, name), os.path.join(configs, name))
    # A config folder with the weights but no T5 tokenizer.
    no_tok = os.path.join(args.out, "flux-no-t5-tokenizer")
    shutil.rmtree(no_tok, ignore_errors=True)
    shutil.copytree(dev, no_tok, ignore=shutil.ignore_patterns("tokenizer_2"))

    broken = {
        "missing-proj": {k: v for k, v in dev_bfl.items() if k != "double_blocks.1.img_attn.proj.weight"},
        "flux2": {**dev_bfl, "double_stream_modulation_img.lin.weight": torch.zeros(6 * dev_inner, dev_inner)},
        "fill": {**dev_bfl, "img_in.weight": torch.zeros(dev_inner, 384)},
        "orphan-scale": {**dev_bfl, "double_blocks.0.img_attn.nothing.scale_weight": torch.ones(1)},
        "bad-scale": {**fp8, "double_blocks.0.img_attn.proj.scale_weight": torch.ones(3)},
        "gap": {k: v for k, v in dev_bfl.items() if not k.startswith("single_blocks.1.")},
    }
    for name, ckpt in broken.items():
        save_file({k: v.contiguous() for k, v in ckpt.items()}, os.path.join(args.out, "broken", name + ".safetensors"))


if __name__ == "__main__":
    main()
