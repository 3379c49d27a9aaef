"""Writes the embedded emoji model's card (<model>/README.md) and its loss curve (docs/emoji-loss.png)
from a diffract-train run folder (loss.csv, summary.json, train.log) and diffract-train eval's JSON."""
import argparse
import csv
import json
import os

from PIL import Image, ImageDraw

ap = argparse.ArgumentParser()
ap.add_argument("--run", help="folder with loss.csv and summary.json")
ap.add_argument("--eval", required=True, help="diffract-train eval output (JSON)")
ap.add_argument("--model", help="the exported model folder")
ap.add_argument("--eval-only", action="store_true",
                help="write only docs/emoji-eval.md (an evaluation of the shipped model without its training run)")
ap.add_argument("--docs", default="docs")
ap.add_argument("--command", default="TRAIN_SCHEDULE_MINUTES=14 ./scripts/gpu_train.sh; TRAIN_SCHEDULE_MINUTES=14 RESUME=1 ./scripts/gpu_train.sh   # back to back, the second resumes")
ap.add_argument("--gpu-eval", help="the same evaluation run on the GPU (JSON), reported beside the CPU one")
args = ap.parse_args()

ev = json.load(open(args.eval))


def setting_text(ev):
    """The background / position measures, when the evaluation has them."""
    if "background_right" not in ev:
        return ""
    n = ev["prompts"]
    return (f" Background colour right {ev['background_right']:.3f} ({round(ev['background_right'] * n)} of {n}), "
            f"position right {ev['position_right']:.3f} ({round(ev['position_right'] * n)} of {n}): "
            f"{ev['setting_metrics']}.")


def write_eval_md(ev, docs):
    setting = "background_right" in ev
    lines = ["# diffract-emoji on its held-out prompts", "",
             f"`diffract-train eval` ({ev['prompts']} prompts never sampled in training, seed 1000 + index, {ev['steps']} steps, "
             f"CFG {ev['cfg']}): top-1 {ev['top1']:.3f}, top-5 {ev['top5']:.3f} (random guessing {ev['random_top1']:.4f} / "
             f"{ev['random_top5']:.4f}). Nearest = the rendered scene of the same setting closest in pixels, over all "
             f"{ev['candidates']} emoji." + setting_text(ev), "", "![held-out contact sheet](emoji-holdout.png)", "",
             "Row-major, 8 a row:", ""]
    if setting:
        lines += ["| # | prompt | nearest emoji | top-1 | top-5 | background seen | position seen |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
    else:
        lines += ["| # | prompt | nearest emoji | top-1 | top-5 |", "| --- | --- | --- | --- | --- |"]
    for i, r in enumerate(ev["results"]):
        row = f"| {i} | {r['prompt']} | {r['nearest']} | {'yes' if r['top1'] else ''} | {'yes' if r['top5'] else ''} |"
        if setting:
            row += (f" {r['background']}{' (right)' if r['background_right'] else ''} |"
                    f" {r['position']}{' (right)' if r['position_right'] else ''} |")
        lines.append(row)
    open(os.path.join(docs, "emoji-eval.md"), "w").write("\n".join(lines) + "\n")


if args.eval_only:
    write_eval_md(ev, args.docs)
    print("wrote", os.path.join(args.docs, "emoji-eval.md"))
    raise SystemExit(0)
if not args.run or not args.model:
    ap.error("--run and --model are needed unless --eval-only")

rows = [r for r in csv.DictReader(open(os.path.join(args.run, "loss.csv")))]
summary = json.load(open(os.path.join(args.run, "summary.json")))
steps = [int(r["step"]) for r in rows]
loss = [float(r["loss"]) for r in rows]

# Loss curve: 640x320, log-free, axes and ticks by hand (PIL only).
w, h, m = 640, 320, 40
img = Image.new("RGB", (w, h), "white")
d = ImageDraw.Draw(img)
lo, hi = min(loss), max(loss)
x = lambda s: m + (s - steps[0]) / max(1, steps[-1] - steps[0]) * (w - 2 * m)
y = lambda v: h - m - (v - lo) / max(1e-9, hi - lo) * (h - 2 * m)
d.line([(m, m), (m, h - m), (w - m, h - m)], fill="black")
d.line([(x(s), y(v)) for s, v in zip(steps, loss)], fill=(200, 40, 40), width=2)
d.text((m, 8), f"diffract-emoji training loss (Min-SNR-weighted eps MSE), {steps[-1]} steps", fill="black")
d.text((m - 36, m - 6), f"{hi:.3f}", fill="black")
d.text((m - 36, h - m - 6), f"{lo:.3f}", fill="black")
d.text((w - m - 30, h - m + 8), str(steps[-1]), fill="black")
os.makedirs(args.docs, exist_ok=True)
img.save(os.path.join(args.docs, "emoji-loss.png"))

size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(args.model) for f in fs)
idx = [0, len(rows) // 4, len(rows) // 2, 3 * len(rows) // 4, len(rows) - 1]
table = "\n".join(f"| {rows[i]['step']} | {float(rows[i]['loss']):.4f} | {float(rows[i]['lr']):.2e} | {rows[i]['seconds']} |"
                  for i in sorted(set(idx)))
gpu_row = ""
if args.gpu_eval:
    g = json.load(open(args.gpu_eval))
    gpu_row = f"| the same on one H200 (bf16) | {g['top1']:.3f} | {g['top5']:.3f} |\n"
card = f"""# diffract-emoji

A small text-to-image model trained from scratch by Diffract's own trainer (`diffract-train`,
LibTorch) for Diffract's first start: emoji on coloured backgrounds, 128x128. Prompts combine an
emoji's Unicode name and a setting: `a small red apple in the top left on a light blue
background`, `a large dog face on a black background`, or just `red apple`.

Format: a diffusers `StableDiffusionPipeline` folder, fp16 weights, {size / 1e6:.1f} MB.

| part | what |
| --- | --- |
| `unet/` | UNet2DConditionModel (64, 128, 192), cross-attention in the two lower levels, 32 latent channels |
| `text_encoder/` | CLIPTextModel, 4 layers, 96 wide, trained from scratch |
| `tokenizer/` | the real CLIP BPE vocabulary (49408 tokens, from OpenAI's `bpe_simple_vocab_16e6.txt.gz`, MIT) |
| `vae/` | AutoencoderTiny: the pretrained TAEF2 (madebyollin/taesd, MIT), FLUX.2's 32-channel latent space; `scaling_factor` {summary['latent_scale']:.4f} measured on the data |
| `scheduler/` | EulerDiscreteScheduler: scaled-linear betas 0.00085..0.012, 1000 steps, epsilon prediction |

diffusers loads the folder (`StableDiffusionPipeline.from_pretrained`); its AutoencoderTiny
lacks TAEF2's mid-block GroupNorm branch (`pool.*` weights), so decode images with Diffract or
use `output_type="latent"` there (the latents match Diffract's; see tests/reference/check_emoji_export.py).

## Data and licences

Rendered by `diffract-dataset` from Debian packages only: every fully-qualified emoji of
`unicode-data` (`/usr/share/unicode/emoji/emoji-test.txt`, Emoji 15.0, Unicode License v3) drawn
with `fonts-noto-color-emoji` (Noto Color Emoji, SIL Open Font License 1.1), skin-tone variants
left out: 1870 sprites of 128x128. Scenes are composed during training: a sprite small, medium or
large, centred or in a corner, on one of 12 named colours, captioned accordingly. The 64
combinations in `resources/training/holdout.tsv` were never sampled in training.

## Training

```
{args.command}
```

{summary['steps']} steps of batch {summary['batch']} ({summary['steps'] * summary['batch'] / 1e6:.2f} M scenes) in
{summary['training_seconds'] / 60:.1f} minutes on {summary['device']} (one H200), {summary['images_per_second']:.0f}
images/s; AdamW (lr {summary['lr']}, warm-up, cosine), EMA 0.999 (these weights), bf16 autocast,
10 % empty captions, Min-SNR-5, gradient clipping at 1.

| step | loss | lr | seconds |
| --- | --- | --- | --- |
{table}

![loss](../../../docs/emoji-loss.png)

## Evaluation

`diffract-train eval`: each held-out prompt generated on CPU (seed 1000 + index, 20 Euler steps,
CFG {ev['cfg']}); is the generated image's nearest rendered scene of the same setting (pixel MSE,
over all {ev['candidates']} emoji) one with the same emoji?

| | top-1 | top-5 |
| --- | --- | --- |
| diffract-emoji ({ev['prompts']} held-out prompts, CPU) | {ev['top1']:.3f} | {ev['top5']:.3f} |
{gpu_row}| random guessing | {ev['random_top1']:.4f} | {ev['random_top5']:.4f} |

{setting_text(ev).strip()}

The GPU draws other initial noise for the same seed (and runs bf16), so its 64 images differ
from the CPU's. 64 prompts are few: one hit is 0.016, so read both rows as "far above chance",
not as two precise rates.
{ev['seconds_per_image']:.2f} s per image on this CPU (2 cores). Contact sheet and per-prompt results:
`docs/emoji-eval.md`.
"""
open(os.path.join(args.model, "README.md"), "w").write(card)

write_eval_md(ev, args.docs)
print("wrote", os.path.join(args.model, "README.md"), "and emoji-loss.png, emoji-eval.md in", args.docs)
