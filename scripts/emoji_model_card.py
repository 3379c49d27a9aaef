"""Writes the embedded emoji models' cards and their loss curves from diffract-train run folders
(loss.csv, summary.json) and diffract-train eval's JSON:
  t2i      the text-to-image model: <model>/README.md, docs/emoji-loss.png, docs/emoji-eval.md
  inpaint  the inpainting model: <model>/README.md, docs/emoji-inpaint-loss.png, docs/emoji-inpaint-eval.md
  lora     the outline-style LoRA: <lora>.md beside the file, docs/emoji-lora-loss.png, docs/emoji-lora-eval.md
Architecture, schedule and sizes are read from the folders, so a card says what the files hold."""
import argparse
import csv
import json
import os

from PIL import Image, ImageDraw

ap = argparse.ArgumentParser()
ap.add_argument("kind", choices=["t2i", "inpaint", "lora"])
ap.add_argument("--run", help="folder with loss.csv and summary.json")
ap.add_argument("--eval", required=True, help="diffract-train eval output (JSON)")
ap.add_argument("--base-eval", help="inpaint / lora: the same evaluation of the base model, for comparison")
ap.add_argument("--model", help="the exported model folder (t2i, inpaint) or LoRA file (lora)")
ap.add_argument("--eval-only", action="store_true", help="write only the evaluation page")
ap.add_argument("--gpu", default="one H100", help="what trained it, for the card")
ap.add_argument("--docs", default="docs")
ap.add_argument("--command", help="the command that trained it (default: scripts/gpu_train.sh's)")
ap.add_argument("--note", default="", help="what is particular to this run, after the training paragraph")
ap.add_argument("--finding", default="", help="what the evaluation shows, after its table")
args = ap.parse_args()

ev = json.load(open(args.eval))
base_ev = json.load(open(args.base_eval)) if args.base_eval else None
PAGES = {"t2i": ("emoji-eval.md", "emoji-holdout.png", "emoji-loss.png"),
         "inpaint": ("emoji-inpaint-eval.md", "emoji-inpaint-holdout.png", "emoji-inpaint-loss.png"),
         "lora": ("emoji-lora-eval.md", "emoji-lora-holdout.png", "emoji-lora-loss.png")}
eval_page, sheet, loss_png = PAGES[args.kind]
COMMANDS = {
    "t2i": "PHASE=train TRAIN_SCHEDULE_MINUTES=14 EXPORT=0 ./scripts/gpu_train.sh; "
           "PHASE=train TRAIN_SCHEDULE_MINUTES=14 RESUME=1 ./scripts/gpu_train.sh   # back to back, the second resumes",
    "inpaint": "PHASE=finetune ./scripts/gpu_train.sh   # on the machine that trained the text-to-image model",
    "lora": "PHASE=finetune ./scripts/gpu_train.sh   # on the machine that trained the text-to-image model"}


def pct(ev, key):
    n = ev["prompts"]
    return f"{ev[key]:.3f} ({round(ev[key] * n)} of {n})"


def setting_text(ev):
    if "background_right" not in ev:
        return ""
    return (f" Background colour right {pct(ev, 'background_right')}, position right {pct(ev, 'position_right')}: "
            f"{ev['setting_metrics']}.")


def describe_task(ev):
    if ev.get("inpaint"):
        return (f"each held-out prompt's setting drawn with another emoji (the next in the atlas), the sprite's box "
                f"(padded by {ev['mask_padding']} px) masked and repainted from the prompt at strength 1; "
                f"the picture outside the mask changed by {ev['unmasked_change']:.4f} on average (mean absolute "
                f"difference, 0..1)")
    if ev.get("lora"):
        return f"with the LoRA `{os.path.basename(ev['lora'])}` at weight 1, compared against {ev['style']}-style scenes"
    return "text to image"


def write_eval_md(ev):
    setting = "background_right" in ev
    inpaint = bool(ev.get("inpaint"))
    title = {"t2i": "diffract-emoji", "inpaint": "diffract-emoji-inpaint", "lora": "the diffract-emoji-outline LoRA"}
    lines = [f"# {title[args.kind]} on its held-out prompts", "",
             f"`diffract-train eval` ({ev['prompts']} prompts never sampled in training, seed 1000 + index, {ev['steps']} steps, "
             f"CFG {ev['cfg']}; {describe_task(ev)}): top-1 {pct(ev, 'top1')}, top-5 {pct(ev, 'top5')} (random guessing "
             f"{ev['random_top1']:.4f} / {ev['random_top5']:.4f}). Nearest = the rendered scene of the same setting closest "
             f"in pixels, over all {ev['candidates']} emoji." + setting_text(ev), "",
             f"![held-out contact sheet]({sheet})", "", "Row-major, 8 a row:", ""]
    head = "| # | prompt | nearest emoji | top-1 | top-5 |"
    rule = "| --- | --- | --- | --- | --- |"
    if setting:
        head += " background seen | position seen |"
        rule += " --- | --- |"
    if inpaint:
        head += " change outside the mask |"
        rule += " --- |"
    lines += [head, rule]
    for i, r in enumerate(ev["results"]):
        row = f"| {i} | {r['prompt']} | {r['nearest']} | {'yes' if r['top1'] else ''} | {'yes' if r['top5'] else ''} |"
        if setting:
            row += (f" {r['background']}{' (right)' if r['background_right'] else ''} |"
                    f" {r['position']}{' (right)' if r['position_right'] else ''} |")
        if inpaint:
            row += f" {r['unmasked_change']:.4f} |"
        lines.append(row)
    open(os.path.join(args.docs, eval_page), "w").write("\n".join(lines) + "\n")


def loss_curve(rows, title, path):
    """640x320, linear axes, ticks by hand (PIL only)."""
    steps = [int(r["step"]) for r in rows]
    loss = [float(r["loss"]) for r in rows]
    w, h, m = 640, 320, 40
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    lo, hi = min(loss), max(loss)
    x = lambda s: m + (s - steps[0]) / max(1, steps[-1] - steps[0]) * (w - 2 * m)
    y = lambda v: h - m - (v - lo) / max(1e-9, hi - lo) * (h - 2 * m)
    d.line([(m, m), (m, h - m), (w - m, h - m)], fill="black")
    d.line([(x(s), y(v)) for s, v in zip(steps, loss)], fill=(200, 40, 40), width=2)
    d.text((m, 8), f"{title}, {steps[-1]} steps", fill="black")
    d.text((m - 36, m - 6), f"{hi:.3f}", fill="black")
    d.text((m - 36, h - m - 6), f"{lo:.3f}", fill="black")
    d.text((w - m - 30, h - m + 8), str(steps[-1]), fill="black")
    img.save(path)


def folder_size(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(path, followlinks=False) for f in fs
               if not os.path.islink(os.path.join(dp, f)))


os.makedirs(args.docs, exist_ok=True)
if args.eval_only:
    write_eval_md(ev)
    print("wrote", os.path.join(args.docs, eval_page))
    raise SystemExit(0)
if not args.run or not args.model:
    ap.error("--run and --model are needed unless --eval-only")

rows = list(csv.DictReader(open(os.path.join(args.run, "loss.csv"))))
summary = json.load(open(os.path.join(args.run, "summary.json")))
loss_title = {"t2i": "diffract-emoji training loss (v-prediction MSE, x0 weighted by clamp(SNR, 1, 5))",
              "inpaint": "diffract-emoji-inpaint fine-tuning loss (as the base's)",
              "lora": "diffract-emoji-outline LoRA training loss (as the base's)"}[args.kind]
loss_curve(rows, loss_title, os.path.join(args.docs, loss_png))
idx = sorted({0, len(rows) // 4, len(rows) // 2, 3 * len(rows) // 4, len(rows) - 1})
table = "\n".join(f"| {rows[i]['step']} | {float(rows[i]['loss']):.4f} | {float(rows[i]['lr']):.2e} | {rows[i]['seconds']} |"
                  for i in idx)
trained = (f"{summary['steps']} steps of batch {summary['batch']} ({summary['steps'] * summary['batch'] / 1e6:.2f} M scenes) "
           f"in {summary['training_seconds'] / 60:.1f} minutes on {args.gpu} ({summary['device']}), "
           f"{summary['images_per_second']:.0f} scenes/s; AdamW (lr {summary['lr']}, warm-up, cosine)")
command = args.command or COMMANDS[args.kind]
note = "\n" + args.note.strip() + "\n" if args.note.strip() else ""
finding = "\n" + args.finding.strip() + "\n" if args.finding.strip() else ""


def eval_row(name, e):
    cells = f"| {name} | {e['top1']:.3f} | {e['top5']:.3f} |"
    if "background_right" in e:
        cells += f" {e['background_right']:.3f} | {e['position_right']:.3f} |"
    if e.get("inpaint"):
        cells += f" {e['unmasked_change']:.4f} |"
    return cells


def eval_table(rows_):
    head = "| | top-1 | top-5 | background right | position right |"
    rule = "| --- | --- | --- | --- | --- |"
    if ev.get("inpaint"):
        head += " change outside the mask |"
        rule += " --- |"
    return "\n".join([head, rule] + [eval_row(n, e) for n, e in rows_])


data = """Rendered by `diffract-dataset` from Debian packages only: every fully-qualified emoji of
`unicode-data` (`/usr/share/unicode/emoji/emoji-test.txt`, Emoji 15.0, Unicode License v3) drawn
with `fonts-noto-color-emoji` (Noto Color Emoji, SIL Open Font License 1.1), skin-tone variants
left out: 1870 sprites of 128x128. Scenes are composed during training: a sprite small, medium or
large, centred or in a corner, on one of 12 named colours, captioned accordingly. The 64
combinations in `resources/training/holdout.tsv` were never sampled in training."""

if args.kind in ("t2i", "inpaint"):
    unet = json.load(open(os.path.join(args.model, "unet", "config.json")))
    text = json.load(open(os.path.join(args.model, "text_encoder", "config.json")))
    sched = json.load(open(os.path.join(args.model, "scheduler", "scheduler_config.json")))
    vae = json.load(open(os.path.join(args.model, "vae", "config.json")))
    size = folder_size(args.model)
    cross = sum(t.startswith("CrossAttn") for t in unet["down_block_types"])
    schedule = (f"EulerDiscreteScheduler: {sched['beta_schedule']} betas {sched['beta_start']}..{sched['beta_end']}"
                f"{' rescaled to zero terminal SNR' if sched.get('rescale_betas_zero_snr') else ''}, "
                f"{sched['num_train_timesteps']} steps, {sched['prediction_type']}, {sched['timestep_spacing']} timesteps")
    parts = f"""| part | what |
| --- | --- |
| `unet/` | UNet2DConditionModel {tuple(unet['block_out_channels'])}, cross-attention in the {cross} lower levels, {unet['out_channels']} latent channels{'; input: the latents, the mask and the masked image' + chr(39) + 's latents (' + str(unet['in_channels']) + ' channels)' if unet['in_channels'] != unet['out_channels'] else ''} |
| `text_encoder/` | CLIPTextModel, {text['num_hidden_layers']} layers, {text['hidden_size']} wide, trained from scratch |
| `tokenizer/` | the real CLIP BPE vocabulary (49408 tokens, from OpenAI's `bpe_simple_vocab_16e6.txt.gz`, MIT) |
| `vae/` | AutoencoderTiny: the pretrained TAEF2 (madebyollin/taesd, MIT), FLUX.2's 32-channel latent space; `scaling_factor` {vae['scaling_factor']:.4f} measured on the data |
| `scheduler/` | {schedule} |"""

if args.kind == "t2i":
    card = f"""# diffract-emoji

A small text-to-image model trained from scratch by Diffract's own trainer (`diffract-train`,
LibTorch) for Diffract's first start: emoji on coloured backgrounds, 128x128. Prompts combine an
emoji's Unicode name and a setting: `a small red apple in the top left on a light blue
background`, `a large dog face on a black background`, or just `red apple`. Beside it:
`../diffract-emoji-inpaint` (the brush's model) and `../loras/diffract-emoji-outline.safetensors`.

Format: a diffusers `StableDiffusionPipeline` folder, fp16 weights, {size / 1e6:.1f} MB.

{parts}

The schedule reaches zero signal at its last step (Lin et al. 2023): with SD's own schedule the
last training step keeps 7 % of the picture, through which a model learns to read a flat
background from the noise, and sampling from pure noise then gives washed-out backgrounds whose
colour follows the seed rather than the prompt, as the previous edition of this model did.

diffusers loads the folder (`StableDiffusionPipeline.from_pretrained`); its AutoencoderTiny
lacks TAEF2's mid-block GroupNorm branch (`pool.*` weights), so decode images with Diffract or
use `output_type="latent"` there (the latents match Diffract's; see tests/reference/check_emoji_export.py).

## Data and licences

{data}

## Training

```
{command}
```

{trained}, EMA 0.999 (these weights), bf16 autocast, 10 % empty captions, v-prediction with the
x0 error weighted by clamp(SNR, 1, 5) (Min-SNR-5 above SNR 1, full weight near pure noise),
gradient clipping at 1.
{note}
| step | loss | lr | seconds |
| --- | --- | --- | --- |
{table}

![loss](../../../docs/{loss_png})

## Evaluation

`diffract-train eval`: each held-out prompt generated on CPU (seed 1000 + index, 20 Euler steps,
CFG {ev['cfg']}); is the generated image's nearest rendered scene of the same setting (pixel MSE,
over all {ev['candidates']} emoji) one with the same emoji, and are its background colour and the
emoji's position the prompt's?

{eval_table([('diffract-emoji (' + str(ev['prompts']) + ' held-out prompts, CPU)', ev)] + ([('the previous edition, same evaluation', base_ev)] if base_ev else []))}
{finding}
Random guessing: top-1 {ev['random_top1']:.4f}, top-5 {ev['random_top5']:.4f}. 64 prompts are few:
one hit is 0.016. {ev['seconds_per_image']:.2f} s per image on this CPU (2 cores). Contact sheet
and per-prompt results: `docs/{eval_page}`.
"""
    out = os.path.join(args.model, "README.md")
elif args.kind == "inpaint":
    card = f"""# diffract-emoji-inpaint

diffract-emoji fine-tuned for inpainting, so that the brush repaints a region from the prompt and
keeps the rest: its UNet also takes the mask and the masked picture's latents (diffusers'
inpainting layout, 2 x 32 + 1 = {unet['in_channels']} input channels). Diffract uses it for inpainting
jobs on the embedded model; other models inpaint by blending.

Format: a diffusers `StableDiffusionInpaintPipeline` folder: its own `unet/` (fp16), and
`text_encoder/`, `tokenizer/`, `vae/`, `scheduler/` as links to `../diffract-emoji`'s (the
fine-tune trains the UNet alone). {size / 1e6:.1f} MB of its own.

{parts}

diffusers' StableDiffusionInpaintPipeline accepts only 4- and 9-channel UNets, so it runs this
one with its gate widened to 2 x latent channels + 1 (tests/reference/check_emoji_inpaint.py,
which matches Diffract's latents on a tiny model of the same layout).

## Data and licences

{data} Masks are drawn per scene: over the emoji (its pixels, dilated 2-10 px; 35 %), a box
(20 %), an ellipse (15 %), a brush stroke (20 %) or everything (10 %); the masked pixels are
blanked (0 in [-1, 1]) before encoding, as the pipelines do.

## Training

```
{command}
```

From diffract-emoji (its EMA weights; the new input channels start at zero, so the fine-tune
starts from its predictions): {trained}, EMA 0.999 with warm-up (these weights), bf16 autocast,
10 % empty captions, the base's loss.
{note}
| step | loss | lr | seconds |
| --- | --- | --- | --- |
{table}

![loss](../../../docs/{loss_png})

## Evaluation

`diffract-train eval --inpaint` on CPU: {describe_task(ev)}.

{eval_table([('diffract-emoji-inpaint', ev)] + ([('diffract-emoji, blending the latents outside the mask', base_ev)] if base_ev else []))}
{finding}
Contact sheet and per-prompt results: `docs/{eval_page}`.
"""
    out = os.path.join(args.model, "README.md")
else:
    from safetensors import safe_open

    with safe_open(args.model, "pt") as f:
        keys = list(f.keys())
        rank = f.get_slice(keys[0]).get_shape()[0] if keys[0].endswith("lora_A.weight") else None
    layers = len(keys) // 2
    card = f"""# diffract-emoji-outline

A LoRA for diffract-emoji trained here: it draws the emoji as outlines (the silhouette and the
edges between colours, in near-black ink on light backgrounds and near-white on dark ones) on
the prompt's background. No trigger word: the LoRA is the style. In the GUI it is listed under
LoRAs on first start; in a prompt, `<lora:diffract-emoji-outline:1>` (weights between 0 and 1
blend the two styles).

Format: a diffusers / PEFT LoRA (`unet.<module>.lora_A.weight` / `lora_B.weight`, fp16, alpha =
rank {rank}): {layers} layers of the UNet's transformer blocks (attention q, k, v, out and the
feed-forward's two layers), {folder_size(args.model) / 1e6:.2f} MB. diffusers' `load_lora_weights`
reads it (tests/reference/check_emoji_lora.py matches Diffract's latents with peft's on a tiny
model).

## Data and licences

{data} Here every scene is drawn in the outline style (`diffract-train scenes --style outline`
shows them), with the same captions.

## Training

```
{command}
```

On the frozen diffract-emoji: {trained}, EMA (warm-up, these weights), bf16 autocast, 10 % empty
captions, the base's loss.
{note}
| step | loss | lr | seconds |
| --- | --- | --- | --- |
{table}

![loss](../../../docs/{loss_png})

## Evaluation

`diffract-train eval --lora ... --style outline` on CPU: the held-out prompts with the LoRA, each
image's nearest scene searched among outline-style scenes.

{eval_table([('with the LoRA, against outline scenes', ev)] + ([('diffract-emoji without it, against outline scenes', base_ev)] if base_ev else []))}
{finding}
Contact sheet and per-prompt results: `docs/{eval_page}`.
"""
    out = os.path.splitext(args.model)[0] + ".md"
open(out, "w").write(card)
write_eval_md(ev)
print("wrote", out, "and", loss_png, eval_page, "in", args.docs)
