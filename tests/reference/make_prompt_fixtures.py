#!/usr/bin/env python3
"""Reference oracle for A1111's prompt syntax: weighted, chunked prompt embeddings computed in
Python (A1111's algorithm re-implemented here: its sd_hijack_clip tokenize_line / process_tokens and
the "Original" emphasis) with transformers' CLIP encoders, and diffusers' pipelines run on those
embeddings (prompt_embeds=...), on make_fixtures.py's tiny-sd / tiny-sdxl (--fixtures).

Writes into --out:
  prompt_cases.json: per case its prompt, negative, settings, and per encoder the chunks' ids and weights;
  prompt_cases.safetensors: per case the embeddings per encoder and diffusers' image (float, HWC).
CPU, fp32, a few seconds.
"""
import argparse
import json
import math
import os
import re

import torch
from safetensors.torch import save_file

torch.set_grad_enabled(False)

CHUNK = 75
COMMA_BACKTRACK = 20


def parse(text):
    """A1111's attention syntax as its documentation states it (weights multiply by nesting; an
    unclosed bracket reaches the end; equal neighbours merge). Written here from the docs."""
    token = re.compile(r"\\[()\[\]\\]|\\|\(|\[|:([+-]?[.\d]+)\)|\)|]|[^\\()\[\]:]+|:")
    out, round_open, square_open = [], [], []

    def scale(start, m):
        for item in out[start:]:
            if item[1] != -1:
                item[1] *= m

    for m in token.finditer(text):
        s, w = m.group(0), m.group(1)
        if s.startswith("\\"):
            out.append([s[1:], 1.0])
        elif s == "(":
            round_open.append(len(out))
        elif s == "[":
            square_open.append(len(out))
        elif w is not None and round_open:
            scale(round_open.pop(), float(w))
        elif s == ")" and round_open:
            scale(round_open.pop(), 1.1)
        elif s == "]" and square_open:
            scale(square_open.pop(), 1 / 1.1)
        else:
            for i, part in enumerate(re.split(r"\s*\bBREAK\b\s*", s)):
                if i:
                    out.append(["BREAK", -1])
                out.append([part, 1.0])
    for p in round_open:
        scale(p, 1.1)
    for p in square_open:
        scale(p, 1 / 1.1)
    out = out or [["", 1.0]]
    merged = []
    for item in out:
        if merged and merged[-1][1] == item[1] and item[1] != -1:
            merged[-1][0] += item[0]
        else:
            merged.append(item)
    return merged


def chunks(tok, text):
    """[(ids[77], weights[77])]: 75 tokens a chunk between bos and eos, comma backtracking."""
    comma = tok.get_vocab().get(",</w>")
    bos, eos, pad = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    result, ids, ws = [], [], []
    state = {"comma": -1}

    def close():
        nonlocal ids, ws
        ids = ids + [eos] * (CHUNK - len(ids))
        ws = ws + [1.0] * (CHUNK - len(ws))
        full = [bos] + ids + [eos]
        if pad != eos:
            first = full.index(eos)
            full = full[:first + 1] + [pad] * (len(full) - first - 1)
        result.append((full, [1.0] + ws + [1.0]))
        ids, ws = [], []
        state["comma"] = -1

    for text_, weight in parse(text):
        if weight == -1 and text_ == "BREAK":
            close()
            continue
        for t in tok(text_, add_special_tokens=False)["input_ids"]:
            if t == comma:
                state["comma"] = len(ids)
            elif len(ids) == CHUNK and state["comma"] != -1 and len(ids) - state["comma"] <= COMMA_BACKTRACK:
                cut = state["comma"] + 1
                moved_ids, moved_ws = ids[cut:], ws[cut:]
                ids, ws = ids[:cut], ws[:cut]
                close()
                ids, ws = moved_ids, moved_ws
            if len(ids) == CHUNK:
                close()
            ids.append(t)
            ws.append(weight)
    if ids or not result:
        close()
    return result


def encode(encoder, tok, text, layer):
    """[1, 77 * chunks, C] weighted as A1111's "Original" emphasis, and the first chunk's pooled output."""
    parts, pooled = [], None
    for ids, ws in chunks(tok, text):
        out = encoder(torch.tensor([ids]), output_hidden_states=True)
        z = out.last_hidden_state if layer == "last" else out.hidden_states[-2]
        if pooled is None:
            pooled = out.text_embeds if hasattr(out, "text_embeds") else out.pooler_output
        mean, size = z.mean(), 1e-3 * z.abs().mean()
        z = z * torch.tensor(ws).view(1, -1, 1)
        if mean.abs() > size and z.mean().abs() > size:  # a mean near zero: no rescale (A1111 gives inf)
            z = z * (mean / z.mean())
        parts.append(z)
    return torch.cat(parts, 1), pooled, chunks(tok, text)


LONG = ("a studio photograph of a (glossy red:1.3) apple on a marble table, soft window light from the left, "
        "[dark] wooden shelves in the background, a glass of water beside it, ((sharp focus)), shallow depth "
        "of field, fresh 85mm lens, warm colour grading, fine film grain, a linen napkin folded under the fruit, "
        "tiny water droplets on the skin, reflections on the glass, a (small green leaf:0.8) on the stem, "
        "the edge of a ceramic bowl at the right, morning, calm mood")

CASES = [
    # name, model, prompt, negative, seed
    ("sd.weighted", "tiny-sd", "a (red:1.4) apple on a [white] background, ((studio lighting))", "blurry", 31),
    # 2 chunks vs 1 (repeated to a common length); the first chunk ends at a comma 3 tokens back.
    ("sd.long", "tiny-sd", LONG, "(blurry:1.2), low quality", 32),
    ("sd.break", "tiny-sd", "a red apple BREAK (on a white table:1.2)", "", 33),
    ("xl.weighted", "tiny-sdxl", "a (red:1.4) apple on a [white] background, ((studio lighting))", "dark", 34),
    ("xl.long", "tiny-sdxl", LONG, "[dark], blurry", 35),
    ("sd3.weighted", "sd3_pipeline/tiny-sd3", "a (red:1.4) apple on a [white] background, ((studio lighting))", "dark", 36),
    # 2 chunks vs 1: the negative's CLIP part padded with the empty prompt's chunk.
    ("sd3.long", "sd3_pipeline/tiny-sd3", LONG, "[dark], blurry", 37),
]


def repeat_to(z, tokens):
    return z.repeat(1, tokens // z.shape[1], 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from diffusers import (EulerDiscreteScheduler, StableDiffusion3Pipeline, StableDiffusionPipeline,
                           StableDiffusionXLPipeline)
    pipes = {"tiny-sd": StableDiffusionPipeline.from_pretrained(os.path.join(args.fixtures, "tiny-sd")),
             "tiny-sdxl": StableDiffusionXLPipeline.from_pretrained(os.path.join(args.fixtures, "tiny-sdxl")),
             "sd3_pipeline/tiny-sd3": StableDiffusion3Pipeline.from_pretrained(
                 os.path.join(args.fixtures, "sd3_pipeline", "tiny-sd3"), text_encoder_3=None, tokenizer_3=None)}
    for name, p in pipes.items():
        if "sd3" not in name:
            p.scheduler = EulerDiscreteScheduler.from_config(p.scheduler.config)
        p.set_progress_bar_config(disable=True)
    tensors, index = {}, []
    for name, model, prompt, negative, seed in CASES:
        pipe = pipes[model]
        sd3 = "sd3" in model
        entry = {"name": name, "model": model, "prompt": prompt, "negative_prompt": negative, "seed": seed,
                 "steps": 4, "cfg": 5.0 if sd3 else 7.5, "width": 64, "height": 64,
                 "sampler": "flow-euler" if sd3 else "euler", "encoders": {}, "embeddings": not sd3}
        encoders = [("l", pipe.text_encoder, pipe.tokenizer, "last" if model == "tiny-sd" else "penultimate")]
        if model != "tiny-sd":
            encoders.append(("g", pipe.text_encoder_2, pipe.tokenizer_2, "penultimate"))
        embeds = {}
        for which, text in (("prompt", prompt), ("negative", negative), ("empty", "")):
            zs, pooled = [], []
            for key, enc, tok, layer in encoders:
                z, pool, ch = encode(enc, tok, text, layer)
                if which != "empty":
                    tensors[f"{name}.{which}.{key}"] = z.contiguous()
                    entry["encoders"].setdefault(key, {})[which] = [{"ids": i, "weights": w} for i, w in ch]
                zs.append(z)
                pooled.append(pool)
            embeds[which] = (torch.cat(zs, -1), pooled[-1] if not sd3 else torch.cat(pooled, -1))
        (pz, pp), (nz, npool) = embeds["prompt"], embeds["negative"]
        if sd3:
            # diffusers' SD3 layout: CLIP-L and -G side by side, padded to the joint width, then T5's
            # 256 tokens (zeros: no T5); the shorter CLIP part padded with the empty prompt's chunk.
            joint = pipe.transformer.config.joint_attention_dim
            empty = embeds["empty"][0]
            longest = max(pz.shape[1], nz.shape[1])
            fill = lambda z: torch.cat([z] + [empty] * ((longest - z.shape[1]) // empty.shape[1]), 1)
            pad = lambda z: torch.cat([torch.nn.functional.pad(fill(z), (0, joint - z.shape[-1])),
                                       torch.zeros(1, 256, joint)], 1)
            kw = dict(prompt_embeds=pad(pz), negative_prompt_embeds=pad(nz), pooled_prompt_embeds=pp,
                      negative_pooled_prompt_embeds=npool)
        else:
            tokens = math.lcm(pz.shape[1], nz.shape[1])
            if model == "tiny-sd" and pz.shape[1] != nz.shape[1]:
                # The property the C++ pipeline relies on: cross-attention over a repeated context is
                # the same as over the context.
                x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
                a = pipe.unet(x, 500, encoder_hidden_states=nz).sample
                b = pipe.unet(x, 500, encoder_hidden_states=repeat_to(nz, tokens)).sample
                assert (a - b).abs().max() < 1e-5, (a - b).abs().max()
            kw = dict(prompt_embeds=repeat_to(pz, tokens), negative_prompt_embeds=repeat_to(nz, tokens))
            if model == "tiny-sdxl":
                kw.update(pooled_prompt_embeds=pp, negative_pooled_prompt_embeds=npool)
        image = pipe(num_inference_steps=4, guidance_scale=entry["cfg"], height=64, width=64, output_type="np",
                     generator=torch.Generator().manual_seed(seed), **kw).images
        tensors[f"{name}.image"] = torch.from_numpy(image).contiguous()
        index.append(entry)
    save_file(tensors, os.path.join(args.out, "prompt_cases.safetensors"))
    with open(os.path.join(args.out, "prompt_cases.json"), "w") as f:
        json.dump(index, f)


if __name__ == "__main__":
    main()
