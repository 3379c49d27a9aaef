#!/usr/bin/env python3
"""Reference oracle for SD3 / SD3.5 single files (Stability's layout, as sd3_medium_incl_clips*.safetensors).

Takes make_sd3_pipeline_fixtures.py's tiny seeded diffusers pipelines (tiny-sd3, tiny-sd3-t5) and a
tiny SD3.5-medium-style pipeline made here (tiny-sd35m: rms qk norm, a dual-attention first block,
the same VAE and CLIP encoders) and writes each as ONE .safetensors in Stability's layout, with this
script's own inverse mapping (diffusers -> original):

  model.diffusion_model.*              MMDiT: joint_blocks.N.{x,context}_block.attn.qkv fused,
                                       ln_q / ln_k, attn.proj, adaLN_modulation.1, mlp.fc1/fc2, x_block.attn2.*,
                                       pos_embed, x_embedder.proj, t_embedder.mlp.{0,2}, y_embedder.mlp.{0,2},
                                       context_embedder, final_layer.{linear, adaLN_modulation.1}; the final
                                       layer's and the last block's context modulation as (shift, scale)
  first_stage_model.*                  LDM VAE (make_single_file_fixtures.vae_to_ldm)
  text_encoders.clip_l.transformer.*   CLIP-L, transformers' keys with text_model.
  text_encoders.clip_g.transformer.*   CLIP-G, transformers' keys with text_model. and text_projection
  text_encoders.t5xxl.transformer.*    T5 encoder, transformers' keys (tiny-sd3-t5 only)

Independent check: diffusers' own SD3Transformer2DModel.from_single_file(path, config=<folder>,
subfolder="transformer") and AutoencoderKL.from_single_file(..., subfolder="vae") must load each file
back into exactly the folder's tensors (torch.equal), and diffusers' SD3 CLIP / T5 conversions
(create_diffusers_clip_model_from_ldm, convert_sd3_t5_checkpoint_to_diffusers) must give the folder's
text encoders (CLIP-L except text_projection, which diffusers replaces by the identity), or this script
fails. That proves the files are in the layout diffusers reads as SD3.

Also written: tiny-sd35m/ (its diffusers folder), sd35m-configs/ (only the text encoders' and VAE's
config.json: the MMDiT's config is left to shape inference), sd3_single_file_cases.safetensors (each
transformer's diffusers output on fixed inputs) and broken files for the loader's error paths.
Needs --fixtures (make_sd3_pipeline_fixtures.py's sd3_pipeline/). CPU, seconds.
"""
import argparse
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

# diffusers name (inside transformer_blocks.N.) -> (stream, original name inside {x,context}_block.)
BLOCK_NAMES = [("attn.norm_q.", "x_block", "attn.ln_q."), ("attn.norm_k.", "x_block", "attn.ln_k."),
               ("attn.norm_added_q.", "context_block", "attn.ln_q."),
               ("attn.norm_added_k.", "context_block", "attn.ln_k."),
               ("attn.to_out.0.", "x_block", "attn.proj."), ("attn.to_add_out.", "context_block", "attn.proj."),
               ("attn2.norm_q.", "x_block", "attn2.ln_q."), ("attn2.norm_k.", "x_block", "attn2.ln_k."),
               ("attn2.to_out.0.", "x_block", "attn2.proj."),
               ("norm1.linear.", "x_block", "adaLN_modulation.1."),
               ("norm1_context.linear.", "context_block", "adaLN_modulation.1."),
               ("ff.net.0.proj.", "x_block", "mlp.fc1."), ("ff.net.2.", "x_block", "mlp.fc2."),
               ("ff_context.net.0.proj.", "context_block", "mlp.fc1."),
               ("ff_context.net.2.", "context_block", "mlp.fc2.")]
QKV = [("attn.to_", "x_block", "attn.qkv."), ("attn2.to_", "x_block", "attn2.qkv."),
       ("attn.add_", "context_block", "attn.qkv.")]
FIXED = [("pos_embed.proj.", "x_embedder.proj."), ("time_text_embed.timestep_embedder.linear_1.", "t_embedder.mlp.0."),
         ("time_text_embed.timestep_embedder.linear_2.", "t_embedder.mlp.2."),
         ("time_text_embed.text_embedder.linear_1.", "y_embedder.mlp.0."),
         ("time_text_embed.text_embedder.linear_2.", "y_embedder.mlp.2."), ("context_embedder.", "context_embedder."),
         ("proj_out.", "final_layer.linear.")]


def shift_scale(t):
    """diffusers' AdaLayerNormContinuous (scale, shift) -> the original (shift, scale)."""
    scale, shift = t.chunk(2, 0)
    return torch.cat([shift, scale], 0)


def transformer_to_sai(sd, num_layers):
    out, qkv = {}, {}

    def put(k, v):
        assert k not in out, k
        out[k] = v.contiguous()

    for key, t in sd.items():
        if key == "pos_embed.pos_embed":
            put("pos_embed", t)
            continue
        if key.startswith("norm_out.linear."):
            put("final_layer.adaLN_modulation.1." + key[len("norm_out.linear."):], shift_scale(t))
            continue
        m = re.match(r"transformer_blocks\.(\d+)\.(.*)", key)
        if m:
            b, rest = int(m.group(1)), m.group(2)
            block = f"joint_blocks.{b}."
            for ours, stream, sai in QKV:
                mm = re.fullmatch(re.escape(ours) + r"(?:(q|k|v)|(q|k|v)_proj)\.(weight|bias)", rest)
                if mm:
                    which = mm.group(1) or mm.group(2)
                    qkv.setdefault(f"{block}{stream}.{sai}{mm.group(3)}", {})[which] = t
                    break
            else:
                for ours, stream, sai in BLOCK_NAMES:
                    if rest.startswith(ours):
                        v = t
                        if ours == "norm1_context.linear." and b == num_layers - 1:
                            v = shift_scale(t)  # the last block's context norm is AdaLayerNormContinuous
                        put(f"{block}{stream}.{sai}{rest[len(ours):]}", v)
                        break
                else:
                    raise KeyError(key)
            continue
        for ours, sai in FIXED:
            if key.startswith(ours):
                put(sai + key[len(ours):], t)
                break
        else:
            raise KeyError(key)
    for k, parts in qkv.items():
        put(k, torch.cat([parts["q"], parts["k"], parts["v"]], 0))
    return out


def sd3_single_file(folder, t5=False):
    tr, tr_cfg = component(folder, "transformer")
    vae, vae_cfg = component(folder, "vae")
    ckpt = {"model.diffusion_model." + k: v for k, v in transformer_to_sai(tr, tr_cfg["num_layers"]).items()}
    ckpt.update({"first_stage_model." + k: v for k, v in vae_to_ldm(vae, vae_cfg).items()})
    for name, key in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
        te = hf_clip_keys(component(folder, name)[0])
        ckpt.update({f"text_encoders.{key}.transformer." + k: v for k, v in te.items()})
    if t5:
        ckpt.update({"text_encoders.t5xxl.transformer." + k: v for k, v in component(folder, "text_encoder_3")[0].items()})
    return {k: v.contiguous() for k, v in ckpt.items()}


def make_tiny_sd35m(base, out):
    """tiny-sd3 with an SD3.5-medium-style MMDiT: rms qk norm (head width 16 visible), attn2 in block 0."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(46)
    tr = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=96, caption_projection_dim=32,
                               pooled_projection_dim=56, out_channels=16, pos_embed_max_size=16, qk_norm="rms_norm",
                               dual_attention_layers=(0,)).eval()
    g = torch.Generator().manual_seed(47)
    for p in tr.parameters():
        p.copy_(0.1 * torch.randn(p.shape, generator=g))
    path = os.path.join(out, "tiny-sd35m")
    shutil.copytree(base, path)
    shutil.rmtree(os.path.join(path, "transformer"))
    tr.save_pretrained(os.path.join(path, "transformer"))
    configs = os.path.join(out, "sd35m-configs")
    for name in ("text_encoder", "text_encoder_2", "vae"):
        os.makedirs(os.path.join(configs, name))
        shutil.copy(os.path.join(path, name, "config.json"), os.path.join(configs, name, "config.json"))
    return path


def assert_equal(path, name, got, expected, skip=()):
    got = {k: v for k, v in got.items() if k not in skip}
    expected = {k: v for k, v in expected.items() if k not in skip}
    if set(got) != set(expected):
        sys.exit(f"{path}: {name}: keys differ: only from the single file {sorted(set(got) - set(expected))[:5]}, "
                 f"only in the folder {sorted(set(expected) - set(got))[:5]}")
    bad = [k for k in expected if not torch.equal(got[k], expected[k])]
    if bad:
        sys.exit(f"{path}: {name}: {len(bad)} tensors differ from the folder's, e.g. {bad[:5]}")
    print(f"{os.path.basename(path)}: {name}: {len(expected)} tensors equal to the folder's")


def check_with_diffusers(path, folder, t5=False):
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import (convert_sd3_t5_checkpoint_to_diffusers,
                                                     create_diffusers_clip_model_from_ldm)
    from transformers import CLIPTextModelWithProjection

    tr = SD3Transformer2DModel.from_single_file(path, config=folder, subfolder="transformer", local_files_only=True)
    assert_equal(path, "transformer", tr.state_dict(), component(folder, "transformer")[0])
    vae = AutoencoderKL.from_single_file(path, config=folder, subfolder="vae", local_files_only=True)
    assert_equal(path, "vae", vae.state_dict(), component(folder, "vae")[0])
    ckpt = load_file(path)
    for name in ("text_encoder", "text_encoder_2"):
        model = create_diffusers_clip_model_from_ldm(CLIPTextModelWithProjection, dict(ckpt), config=folder,
                                                     subfolder=name, local_files_only=True)
        got, expected = hf_clip_keys(model.state_dict()), hf_clip_keys(component(folder, name)[0])
        skip = ()
        if name == "text_encoder":  # diffusers gives SD3's CLIP-L an identity projection, whatever the file holds
            w = got["text_projection.weight"]
            assert torch.equal(w, torch.eye(w.shape[0])), "diffusers' CLIP-L projection is no longer the identity"
            skip = ("text_projection.weight",)
        assert_equal(path, name, got, expected, skip)
    if t5:
        got = convert_sd3_t5_checkpoint_to_diffusers(dict(ckpt))
        assert_equal(path, "text_encoder_3", got, component(folder, "text_encoder_3")[0])


def reference_outputs(folder, prefix):
    from diffusers import SD3Transformer2DModel

    tr = SD3Transformer2DModel.from_pretrained(os.path.join(folder, "transformer")).eval()
    c = tr.config
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, c.in_channels, 8, 12, generator=g)
    ctx = torch.randn(2, 7, c.joint_attention_dim, generator=g)
    pooled = torch.randn(2, c.pooled_projection_dim, generator=g)
    t = torch.tensor([999.0, 321.5])
    y = tr(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t).sample
    return {f"{prefix}.x": x, f"{prefix}.context": ctx, f"{prefix}.pooled": pooled, f"{prefix}.t": t,
            f"{prefix}.out": y}


def bad_inputs(out, ckpt):
    drop = lambda prefix: {k: v for k, v in ckpt.items() if not k.startswith(prefix)}
    save_file(drop("first_stage_model."), os.path.join(out, "sd3_no_vae.safetensors"))
    save_file(drop("text_encoders.clip_g."), os.path.join(out, "sd3_no_clip_g.safetensors"))
    save_file(drop("text_encoders."), os.path.join(out, "sd3_no_text_encoders.safetensors"))
    truncated = dict(ckpt)
    del truncated["model.diffusion_model.joint_blocks.1.context_block.attn.qkv.weight"]
    save_file(truncated, os.path.join(out, "sd3_truncated.safetensors"))
    wrong = dict(ckpt)
    w = wrong["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"]
    wrong["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"] = w[:, :-1].contiguous()
    save_file(wrong, os.path.join(out, "sd3_wrong_shape.safetensors"))
    # An SDXL-style 4-channel VAE beside the 16-channel MMDiT.
    mixed = dict(ckpt)
    k = "first_stage_model.decoder.conv_in.weight"
    mixed[k] = mixed[k][:, :4].contiguous()
    save_file(mixed, os.path.join(out, "sd3_vae4.safetensors"))
    # A tensor the MMDiT binds but with another shape than the config folder says (context_embedder narrower).
    narrow = dict(ckpt)
    narrow["model.diffusion_model.y_embedder.mlp.0.weight"] = narrow["model.diffusion_model.y_embedder.mlp.0.weight"][:, :-8].contiguous()
    save_file(narrow, os.path.join(out, "sd3_narrow_pooled.safetensors"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", required=True, help="make_sd3_pipeline_fixtures.py's output (tiny-sd3, tiny-sd3-t5)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    sd3, sd3_t5 = os.path.join(args.fixtures, "tiny-sd3"), os.path.join(args.fixtures, "tiny-sd3-t5")
    sd35m = make_tiny_sd35m(sd3, args.out)
    refs = {}
    files = {}
    for name, folder, t5 in (("tiny-sd3", sd3, False), ("tiny-sd3-t5", sd3_t5, True), ("tiny-sd35m", sd35m, False)):
        ckpt = sd3_single_file(folder, t5)
        path = os.path.join(args.out, name + ".safetensors")
        save_file(ckpt, path, metadata={"format": "pt"})
        files[name] = ckpt
        check_with_diffusers(path, folder, t5)
        refs.update(reference_outputs(folder, name))
    save_file({k: v.contiguous() for k, v in refs.items()}, os.path.join(args.out, "sd3_single_file_cases.safetensors"))
    bad_inputs(args.out, files["tiny-sd3"])
    with open(os.path.join(args.out, "STAMP"), "w") as f:
        f.write("ok\n")


if __name__ == "__main__":
    main()
