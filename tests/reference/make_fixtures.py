#!/usr/bin/env python3
"""Reference oracle: tiny seeded models and their outputs, made by diffusers / transformers.

The C++ tests load what this writes and compare tensor by tensor. Everything is written into
--out (the build tree), never committed. Runs on CPU in well under a minute.
"""
import argparse
import gzip
import json
import os
import random

import torch
from safetensors.torch import save_file

torch.set_grad_enabled(False)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)


# --- safetensors: one tensor of every dtype, values known independently ----------------------
def make_dtypes(out):
    base = torch.tensor([[0.0, 1.0, -2.5], [3.25, -0.125, 100.0]])
    tensors = {
        "f64": base.double(), "f32": base.float(), "f16": base.half(), "bf16": base.bfloat16(),
        "f8_e4m3": base.to(torch.float8_e4m3fn), "f8_e5m2": base.to(torch.float8_e5m2),
        "i64": torch.tensor([[-(2**40), 7, 0], [1, 2, 3]], dtype=torch.int64),
        "i32": torch.tensor([[-5, 7, 0], [2**30, 2, 3]], dtype=torch.int32),
        "i16": torch.tensor([[-5, 7, 0], [300, 2, 3]], dtype=torch.int16),
        "i8": torch.tensor([[-5, 7, 0], [100, 2, 3]], dtype=torch.int8),
        "u8": torch.tensor([[255, 7, 0], [100, 2, 3]], dtype=torch.uint8),
        "bool": torch.tensor([[True, False, True], [False, False, True]]),
        "scalar": torch.tensor(4.5),
        "empty": torch.zeros(0, 3),
    }
    save_file(tensors, os.path.join(out, "dtypes.safetensors"), metadata={"format": "pt", "made_by": "oracle"})
    write_json(os.path.join(out, "dtypes.json"),
               {k: {"shape": list(v.shape), "values": v.double().flatten().tolist()} for k, v in tensors.items()})

    # A sharded checkpoint as transformers writes it.
    g = torch.Generator().manual_seed(1)
    shard = {f"layer.{i}.weight": torch.randn(4, 4, generator=g) for i in range(5)}
    d = os.path.join(out, "sharded")
    os.makedirs(d, exist_ok=True)
    names = sorted(shard)
    parts = [names[:3], names[3:]]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({n: shard[n] for n in part}, os.path.join(d, fname))
        weight_map.update({n: fname for n in part})
    write_json(os.path.join(d, "model.safetensors.index.json"), {"metadata": {"total_size": 5 * 64}, "weight_map": weight_map})
    save_file(shard, os.path.join(d, "expected.safetensors"))


# --- torch.save checkpoints (.pth): the real TAEF2 weights --------------------------------------
def make_pth(out, shared):
    for part in ("encoder", "decoder"):
        src = os.path.join(shared, "data", "taesd", f"taef2_{part}.pth")
        sd = torch.load(src, map_location="cpu", weights_only=True)
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out, f"taef2_{part}.expected.safetensors"))


# --- CLIP tokenizer ----------------------------------------------------------------------------
def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_vocab_merges(bpe_gz, d):
    """The HF vocab.json / merges.txt that OpenAI's BPE file defines (as CLIP's export did)."""
    merges = gzip.open(bpe_gz).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    merges = [tuple(m.split()) for m in merges]
    vocab = bytes_to_unicode()
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    os.makedirs(d, exist_ok=True)
    write_json(os.path.join(d, "vocab.json"), {v: i for i, v in enumerate(vocab)})
    with open(os.path.join(d, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")


def prompts():
    fixed = [
        "", " ", "a photo of a cat", "A PHOTO OF A CAT", "a red apple on a white background, studio lighting",
        "high-heeled shoe, product shot, 8k, octane render", "it's a dog's life; they're here, we've won, I'm sure, you'll see, he'd go",
        "IT'S LOUD", "rock'n'roll", "''s '''t", "don't!", "3.14159 is pi", "1234567890", "100% cotton, $49.99 (sale)",
        "e-mail: someone@example.com", "https://example.com/path?q=1&r=2#frag", "C:\\Users\\me\\file.png",
        "tabs\tand\nnewlines\r\nand   spaces", "non\u00a0breaking\u3000ideographic\u2003em space", "trailing space ",
        "café crème brûlée", "cafe\u0301 (decomposed)", "Ångström ÅNGSTRÖM", "naïve façade coöperate", "Straße STRASSE",
        "İstanbul ıi", "ΟΔΥΣΣΕΥΣ Σίσυφος", "Москва ПРИВЕТ мир", "東京タワー 夜景", "北京烤鸭, 中文提示词", "한국어 프롬프트",
        "مرحبا بالعالم", "שלום עולם", "हिन्दी पाठ", "ภาษาไทย", "ﬁne ligature ﬀ", "ｆｕｌｌｗｉｄｔｈ １２３",
        "x² + y³ = z⁴", "½ cup, ¾ inch, Ⅻ o'clock, ⅷ", "٣ arabic digit, ३ devanagari digit", "😀 grinning face",
        "👩‍💻 woman technologist", "👍🏽 thumbs up: medium skin tone", "🇫🇷 flag of France", "❤️ red heart", "🍎🍌🍇 fruit",
        "emoji in text🙂between words", "…ellipsis—em dash–en dash", "“curly quotes” ‘single’ «guillemets»",
        "bullet • point · middle dot", "¿qué? ¡sí!", "™ ® © ℠", "€ £ ¥ ₹ ₿", "<html> & </html>", "a<|endoftext|>b",
        "<|startoftext|>hello", "<|ENDOFTEXT|> shouted", "!!!???...,,,", "#hashtag @mention", "snake_case and kebab-case",
        "CamelCaseWordsHere", "a" * 300, "word " * 100, ("a long prompt about a product photo " * 12).strip(),
        "\u200bzero\u200bwidth\u200b", "soft\u00adhyphen", "control\u0007bell\u0000null", "\ufeffBOM at start",
        "combining \u0041\u030a vs \u00c5", "hangul jamo \u1100\u1161\u11a8", "Ǆ ǅ ǆ titlecase digraph", "ﬃ ligature", "K kelvin sign",
        "µ micro vs μ mu", "ΐ precomposed", "ﾊﾝｶｸ halfwidth katakana", "ミ ツ カ ン", "Ⓐ circled", "ℌ fraktur", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math",
        "𝟏𝟐𝟑 math digits", "emoji zwj 👨‍👩‍👧‍👦 family", "keycap 1️⃣", "older 0x1F600: \U0001F600", "I'M 'quoted' 'S",
    ]
    rng = random.Random(1234)
    words = ("photo red blue product shot studio lighting minimal white background lifestyle scene hero banner "
             "flat lay top view bottle perfume watch sneaker chair lamp glossy matte reflective soft shadow "
             "cinematic 35mm bokeh detailed sharp focus award winning trending vibrant pastel").split()
    pools = [
        "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿ", "ÀÁÂÃÄÅÆÇÈÉÊËÌÍÎÏÑÒÓÔÕÖØÙÚÛÜÝ", "αβγδεζηθικλμνξοπρσςτυφχψω", "ΑΒΓΔΕΖΗΘΣΩ",
        "абвгдежзийклмнопрстуфхцчшщъыьэюя", "АБВГДЕЖЗИЙ", "日本語中文漢字花火", "ひらがなカタカナ", "0123456789",
        "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", "😀😎🍕🚀🎉✨🔥💧🌈⭐", "²³¹¼½¾ⅠⅡⅢ٠١٢", " \t\n", "’“”–—…",
    ]
    generated = []
    while len(generated) < 480:
        parts = []
        for _ in range(rng.randint(1, 30)):
            r = rng.random()
            if r < 0.55:
                w = rng.choice(words)
                parts.append(w.upper() if rng.random() < 0.1 else w.capitalize() if rng.random() < 0.2 else w)
            elif r < 0.7:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 6))))
            else:
                pool = rng.choice(pools)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        sep = rng.choice([" ", " ", ", ", "", "  ", "-", "'"])
        generated.append(sep.join(parts))
    return fixed + generated


def make_tokenizers(out, bpe_gz):
    from transformers import CLIPTokenizer

    raw = os.path.join(out, "clip_vocab")
    write_vocab_merges(bpe_gz, raw)
    tok_l = CLIPTokenizer(os.path.join(raw, "vocab.json"), os.path.join(raw, "merges.txt"), model_max_length=77)
    tok_g = CLIPTokenizer(os.path.join(raw, "vocab.json"), os.path.join(raw, "merges.txt"), model_max_length=77, pad_token="!")
    tok_l.save_pretrained(os.path.join(out, "tokenizer_l"))
    tok_g.save_pretrained(os.path.join(out, "tokenizer_g"))
    # Reload as a user's folder would be loaded, so the saved files are what is checked.
    tok_l = CLIPTokenizer.from_pretrained(os.path.join(out, "tokenizer_l"))
    tok_g = CLIPTokenizer.from_pretrained(os.path.join(out, "tokenizer_g"))
    cases = []
    for p in prompts():
        enc_l = tok_l(p, padding="max_length", max_length=77, truncation=True)
        enc_g = tok_g(p, padding="max_length", max_length=77, truncation=True)
        full = tok_l(p)["input_ids"]
        cases.append({"prompt": p, "ids_l": enc_l["input_ids"], "mask_l": enc_l["attention_mask"],
                      "ids_g": enc_g["input_ids"], "full_length": len(full)})
    write_json(os.path.join(out, "tokenizer_cases.json"), cases)
    return tok_l, tok_g


# --- CLIP text encoders and tiny diffusers pipelines -------------------------------------------
def tiny_clip_config(act, projection):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=49408, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                          num_attention_heads=4, max_position_embeddings=77, hidden_act=act, projection_dim=projection,
                          bos_token_id=49406, eos_token_id=2, pad_token_id=1, layer_norm_eps=1e-5)


def make_text_encoders(out, tok_l, tok_g):
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    enc_l = CLIPTextModel(tiny_clip_config("quick_gelu", 32)).eval()
    torch.manual_seed(1)
    cfg_g = tiny_clip_config("gelu", 24)
    cfg_g.eos_token_id = 49407  # the newer convention: pooled at the first EOS id
    enc_g = CLIPTextModelWithProjection(cfg_g).eval()
    prompts_ = ["a photo of a cat", "", "a red apple on a white background, studio lighting, 8k, ultra detailed"]
    ids_l = tok_l(prompts_, padding="max_length", max_length=77, truncation=True, return_tensors="pt")["input_ids"]
    ids_g = tok_g(prompts_, padding="max_length", max_length=77, truncation=True, return_tensors="pt")["input_ids"]
    o_l = enc_l(ids_l, output_hidden_states=True)
    o_g = enc_g(ids_g, output_hidden_states=True)
    save_file({
        "l.input_ids": ids_l, "l.last_hidden_state": o_l.last_hidden_state, "l.penultimate": o_l.hidden_states[-2],
        "l.embeddings": o_l.hidden_states[0], "l.pooled": o_l.pooler_output,
        "g.input_ids": ids_g, "g.last_hidden_state": o_g.last_hidden_state, "g.penultimate": o_g.hidden_states[-2],
        "g.text_embeds": o_g.text_embeds,
    }, os.path.join(out, "clip_text_cases.safetensors"))
    return enc_l, enc_g


def make_pipelines(out, enc_l, enc_g, tok_l, tok_g):
    from diffusers import (AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline,
                           StableDiffusionXLPipeline, UNet2DConditionModel)

    torch.manual_seed(2)
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=2, sample_size=16, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=8, norm_num_groups=8)
    vae = AutoencoderKL(block_out_channels=[16, 32], in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        norm_num_groups=8, sample_size=32)
    sched = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                   timestep_spacing="leading", steps_offset=1)
    sd = StableDiffusionPipeline(vae=vae, text_encoder=enc_l, tokenizer=tok_l, unet=unet, scheduler=sched,
                                 safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    sd.save_pretrained(os.path.join(out, "tiny-sd"))
    sd.save_pretrained(os.path.join(out, "tiny-sd-fp16"), variant="fp16")
    # A model whose UNet output is NaN, for the NaN-detection test.
    nan_dir = os.path.join(out, "tiny-sd-nan")
    sd.save_pretrained(nan_dir)
    from safetensors.torch import load_file
    w = load_file(os.path.join(nan_dir, "unet", "diffusion_pytorch_model.safetensors"))
    w["conv_out.bias"] = torch.full_like(w["conv_out.bias"], float("nan"))
    save_file(w, os.path.join(nan_dir, "unet", "diffusion_pytorch_model.safetensors"))

    torch.manual_seed(3)
    unet_xl = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=2, sample_size=16, in_channels=4,
                                   out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                   up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=64,
                                   attention_head_dim=(2, 4), use_linear_projection=True,
                                   addition_embed_type="text_time", addition_time_embed_dim=8,
                                   projection_class_embeddings_input_dim=24 + 6 * 8, transformer_layers_per_block=(1, 2),
                                   norm_num_groups=8)
    xl = StableDiffusionXLPipeline(vae=vae, text_encoder=enc_l, text_encoder_2=enc_g, tokenizer=tok_l, tokenizer_2=tok_g,
                                   unet=unet_xl, scheduler=sched)
    xl.save_pretrained(os.path.join(out, "tiny-sdxl"))
    # The same SDXL with force_zeros_for_empty_prompt off: an empty negative prompt is encoded.
    xl_encoded = StableDiffusionXLPipeline(vae=vae, text_encoder=enc_l, text_encoder_2=enc_g, tokenizer=tok_l,
                                           tokenizer_2=tok_g, unet=unet_xl, scheduler=sched,
                                           force_zeros_for_empty_prompt=False)
    xl_encoded.save_pretrained(os.path.join(out, "tiny-sdxl-encoded-negative"))
    return sd, xl, xl_encoded


def make_unet_cases(out, sd, xl):
    """One denoiser call per UNet on seeded inputs, odd latent sizes included."""
    g = torch.Generator().manual_seed(5)
    cases = {}
    for name, unet, ctx_dim in (("sd", sd.unet, 32), ("xl", xl.unet, 64)):
        for h, w in ((16, 16), (13, 10)):
            key = f"{name}.{h}x{w}"
            x = torch.randn(2, 4, h, w, generator=g)
            t = torch.tensor([999.0, 421.5])
            ctx = torch.randn(2, 77, ctx_dim, generator=g)
            kwargs = {}
            if name == "xl":
                text_embeds = torch.randn(2, 24, generator=g)
                time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0], [80.0, 48.0, 8.0, 4.0, 64.0, 64.0]])
                kwargs["added_cond_kwargs"] = {"text_embeds": text_embeds, "time_ids": time_ids}
                cases[key + ".text_embeds"] = text_embeds
                cases[key + ".time_ids"] = time_ids
            y = unet(x, t, encoder_hidden_states=ctx, **kwargs).sample
            cases.update({key + ".x": x, key + ".t": t, key + ".context": ctx, key + ".out": y})
    save_file(cases, os.path.join(out, "unet_cases.safetensors"))


SAMPLERS = {
    "euler": ("EulerDiscreteScheduler", {}),
    "euler-ancestral": ("EulerAncestralDiscreteScheduler", {}),
    "ddim": ("DDIMScheduler", {}),
    "ddpm": ("DDPMScheduler", {}),
    "dpmpp-2m": ("DPMSolverMultistepScheduler", {}),
    "dpmpp-2m-karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
}


def make_pipeline_cases(out, sd, xl, xl_encoded):
    """Whole text-to-image runs through diffusers, as the C++ pipeline must reproduce them."""
    import diffusers

    cases, index = {}, []
    # Every sampler starts from the model's own scheduler config, never from the previous
    # sampler's (from_config would carry over keys such as use_karras_sigmas).
    saved = {id(p): dict(p.scheduler.config) for p in (sd, xl, xl_encoded)}
    folders = {id(sd): "tiny-sd", id(xl): "tiny-sdxl", id(xl_encoded): "tiny-sdxl-encoded-negative"}

    def run(name, pipe, sampler, **kw):
        cls, extra = SAMPLERS[sampler]
        pipe.scheduler = getattr(diffusers, cls).from_config(saved[id(pipe)], **extra)
        seed = kw.pop("seed")
        image = pipe(generator=torch.Generator().manual_seed(seed), output_type="np", **kw).images
        cases[name] = torch.from_numpy(image)
        entry = {"name": name, "model": folders[id(pipe)], "sampler": sampler, "seed": seed, **kw}
        # What the negative branch was, by diffusers' own rule (an SDXL pipeline zeros a negative
        # prompt not given when its config's force_zeros_for_empty_prompt is true).
        cfg = kw.get("guidance_scale", 5.0) > 1
        zeros = (isinstance(pipe, diffusers.StableDiffusionXLPipeline) and kw.get("negative_prompt") is None
                 and pipe.config.force_zeros_for_empty_prompt)
        entry["negative_conditioning"] = "none" if not cfg else "zeros" if zeros else "encoded"
        entry.setdefault("negative_prompt", "")
        entry["negative_prompt"] = entry["negative_prompt"] or ""
        index.append(entry)

    base = dict(prompt="a red apple on a white background", num_inference_steps=5, guidance_scale=7.5,
                height=64, width=64)
    for sampler in SAMPLERS:
        run(f"sd.{sampler}", sd, sampler, seed=11, **base)
    run("sd.nocfg", sd, "euler", seed=3, **{**base, "guidance_scale": 1.0})
    run("sd.negative.batch2", sd, "euler-ancestral", seed=5,
        **{**base, "negative_prompt": "blurry, low quality", "num_images_per_prompt": 2, "width": 48})
    xl_base = dict(base, height=64, width=96)
    run("xl.euler", xl, "euler", seed=21, **xl_base)
    run("xl.dpmpp-2m-karras", xl, "dpmpp-2m-karras", seed=22, **xl_base)
    run("xl.negative", xl, "ddim", seed=23, **{**xl_base, "negative_prompt": "dark"})
    for sampler in ("euler", "dpmpp-2m"):
        run(f"xl.encoded-negative.{sampler}", xl_encoded, sampler, seed=24, **xl_base)
    cases["randn.seed42"] = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(42))
    save_file({k: v.contiguous() for k, v in cases.items()}, os.path.join(out, "pipeline_cases.safetensors"))
    write_json(os.path.join(out, "pipeline_cases.json"), index)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shared", required=True, help="the shared/ folder (CLIP BPE, TAEF2 weights)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    make_dtypes(args.out)
    make_pth(args.out, args.shared)
    tok_l, tok_g = make_tokenizers(args.out, os.path.join(args.shared, "data", "clip", "bpe_simple_vocab_16e6.txt.gz"))
    enc_l, enc_g = make_text_encoders(args.out, tok_l, tok_g)
    sd, xl, xl_encoded = make_pipelines(args.out, enc_l, enc_g, tok_l, tok_g)
    make_unet_cases(args.out, sd, xl)
    make_pipeline_cases(args.out, sd, xl, xl_encoded)
    with open(os.path.join(args.out, "STAMP"), "w") as f:
        f.write("ok\n")


if __name__ == "__main__":
    main()
