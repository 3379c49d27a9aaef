#!/usr/bin/env python3
"""Reference oracle for T5 (SD3's text_encoder_3 / tokenizer_3): a small SentencePiece model and tiny T5 encoders.

Writes into --out only: `tokenizer/` (a unigram SentencePiece model of 600 pieces trained here on the
repository's Markdown, saved as transformers' T5Tokenizer saves it: spiece.model, tokenizer.json,
tokenizer_config.json), t5_tokenizer_cases.json (texts, max_length and the ids transformers' T5Tokenizer
gives with padding="max_length", truncation=True, as diffusers' SD3 calls it), `tiny-t5-gated/` (T5 v1.1
layout: gated-gelu) and `tiny-t5-relu/` (the original T5's relu), each a seeded transformers
T5EncoderModel, and t5_encoder_cases.safetensors with per model the input ids, the embeddings, block 1's
output and last_hidden_state (also with an attention mask), for the same input ids. CPU, fp32, a few seconds.
"""
import argparse
import glob
import json
import os
import shutil

import sentencepiece as spm
import torch
from safetensors.torch import save_file
from transformers import T5Config, T5EncoderModel, T5Tokenizer

torch.set_grad_enabled(False)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Odd inputs on purpose: empty, extra and odd whitespace, accents, CJK and emoji (unknown to the
# small model), NFKC-folded forms, T5's special tokens inside the text, and a text over max_length.
TOKENIZER_CASES = [
    ("a red apple on a white background", 32),
    ("", 16),
    ("   extra    spaces   around  ", 24),
    ("tabs\tand\nnew lines\r\n here", 24),
    ("héllo wörld, naïve café ✨ 日本語 🍎", 48),
    ("ＦＵＬＬＷＩＤＴＨ ﬁne ½ ™", 32),
    ("a </s> in the middle and <pad> <unk> tokens", 32),
    ("sentinels <extra_id_0> and <extra_id_99><extra_id_7> but not <extra_id_100> or <extra_id_>", 48),
    ("The GUI never blocks on the engine; every strategy plugs in at one of three levels. " * 12, 64),
    ("The GUI never blocks on the engine; every strategy plugs in at one of three levels. " * 12, 256),
    ("x" * 300, 256),
    ("UPPER lower MiXeD 12345 3.14 -- (brackets) [more] {braces} \"quotes\" 'single'", 48),
]


def train_tokenizer(out_dir):
    """A T5-style SentencePiece model (<pad> 0, </s> 1, <unk> 2, no BOS) saved as a tokenizer folder."""
    files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    lines = [line for f in files for line in open(f, encoding="utf-8").read().splitlines() if line.strip()]
    # A fresh folder: a tokenizer.json left by an earlier run (the docs it trains on change) would
    # be loaded in place of the new spiece.model.
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir, exist_ok=True)
    prefix = os.path.join(out_dir, "spiece")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=600,
                                   model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   character_coverage=0.9995, num_threads=1, minloglevel=2)
    os.remove(prefix + ".vocab")
    tok = T5Tokenizer.from_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return T5Tokenizer.from_pretrained(out_dir)


def tiny_t5(vocab_size, d_model, feed_forward_proj, seed, num_layers=3):
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model + 5, num_layers=num_layers,
                   num_heads=4, relative_attention_num_buckets=32, relative_attention_max_distance=128,
                   feed_forward_proj=feed_forward_proj, layer_norm_epsilon=1e-6, dropout_rate=0.0)
    model = T5EncoderModel(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1000)
    for name, p in model.named_parameters():  # norms off one, so that their weights count
        if "layer_norm" in name:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tok = train_tokenizer(os.path.join(args.out, "tokenizer"))
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.out, "tokenizer", "spiece.model"))
    cases = []
    for text, max_length in TOKENIZER_CASES:
        ids = tok(text, padding="max_length", max_length=max_length, truncation=True).input_ids
        assert len(ids) == max_length
        if "<" not in text:  # the slow, SentencePiece-based T5Tokenizer: sp.encode, truncate, </s>, pad
            slow = sp.encode(text)[: max_length - 1] + [1]
            assert ids == slow + [0] * (max_length - len(slow)), (text, ids, slow)
        cases.append(dict(text=text, max_length=max_length, ids=ids,
                          unpadded=tok(text).input_ids))
    with open(os.path.join(args.out, "t5_tokenizer_cases.json"), "w", encoding="utf-8") as f:
        json.dump(dict(vocab_size=len(tok), cases=cases), f, indent=1, ensure_ascii=False)

    tensors = {}
    ids = torch.tensor([tok("a red apple on a white background", padding="max_length", max_length=40).input_ids,
                        tok("The GUI never blocks on the engine " * 8, padding="max_length", max_length=40,
                            truncation=True).input_ids])
    mask = (ids != 0).long()
    tensors.update({"input_ids": ids, "attention_mask": mask})
    for name, proj, seed in [("gated", "gated-gelu", 50), ("relu", "relu", 51)]:
        model = tiny_t5(len(tok), 48, proj, seed)
        model.save_pretrained(os.path.join(args.out, f"tiny-t5-{name}"))
        out = model(input_ids=ids, output_hidden_states=True)
        masked = model(input_ids=ids, attention_mask=mask)
        tensors.update({f"{name}.embeddings": out.hidden_states[0], f"{name}.block1": out.hidden_states[2],
                        f"{name}.last_hidden_state": out.last_hidden_state,
                        f"{name}.masked.last_hidden_state": masked.last_hidden_state})
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(args.out, "t5_encoder_cases.safetensors"))


if __name__ == "__main__":
    main()
