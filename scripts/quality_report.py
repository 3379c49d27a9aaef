"""What each approximate strategy costs in quality on the real embedded model (diffract-emoji):
`diffract-cli compare` for every multi-device strategy and step cache over held-out prompts (CPU
virtual devices: the images are what GPUs would make, the timings mean nothing), summarised in
docs/quality-emoji.md with a sheet of one prompt's images (docs/quality-emoji.png). The step caches
run at settings whose model work matches step skipping's and DRiffusion's speed-ups (1.5x, 2x,
3x), so that each is compared at equal speed.

  .venv/bin/python scripts/quality_report.py [--cli build/default/app/diffract-cli] [--prompts 12]
"""
import argparse
import csv
import os
import re
import statistics
import subprocess
import tempfile

from PIL import Image, ImageDraw

# (strategy, devices / skip / threshold): the value is the strategy's --devices, --skip for the
# ones that skip (step-skip, deepcache), --cache-threshold for the threshold caches.
STRATEGIES = [("cfg-parallel", 2), ("hybrid-cfg", 2), ("driffusion", 2), ("driffusion-aggressive", 2),
              ("driffusion", 4), ("driffusion-aggressive", 4), ("cfg-driffusion-aggressive", 4), ("asyncdiff", 2),
              ("asyncdiff", 3), ("distrifusion", 2), ("step-skip", 2), ("step-skip", 3), ("step-skip", 4),
              ("deepcache", 2), ("deepcache", 3), ("deepcache", 4), ("deepcache", 5), ("fbcache", 0.1),
              ("fbcache", 0.2), ("fbcache", 0.3), ("cfg-deepcache", 3), ("cfg-fbcache", 0.1), ("cfg-fbcache", 0.2),
              ("fp8", 0)]
SKIPS = {"step-skip", "deepcache", "cfg-deepcache"}
THRESHOLDS = {"fbcache", "teacache", "cfg-fbcache"}

ap = argparse.ArgumentParser()
ap.add_argument("--cli", default="build/default/app/diffract-cli")
ap.add_argument("--holdout", default="resources/training/holdout.tsv")
ap.add_argument("--prompts", type=int, default=12)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--cfg", type=float, default=5.0)
ap.add_argument("--docs", default="docs")
args = ap.parse_args()

# The hold-out file names the settings; the captions are spelled as diffract-train spells them.
rows = list(csv.DictReader(open(args.holdout), delimiter="\t"))[: args.prompts]


def caption(r):
    a = "an" if r["colour"][0] in "aeiou" else "a"
    return f"a {r['scale']} {r['name']} in the {r['position']} on {a} {r['colour']} background"


results = {s: [] for s in STRATEGIES}
sheet = []
with tempfile.TemporaryDirectory() as tmp:
    for i, r in enumerate(rows):
        prompt = caption(r)
        for name, n in STRATEGIES:
            out = os.path.join(tmp, f"{i}-{name}-{n}")
            flag = "--skip" if name in SKIPS else "--cache-threshold" if name in THRESHOLDS else "--devices"
            # fp8: the plain loop with e4m3 linear layers (emulated on the CPU) against bf16.
            how = ["--strategy", "single", "--precision", "fp8"] if name == "fp8" else ["--strategy", name, flag, str(n)]
            text = subprocess.run([args.cli, "compare", "--prompt", prompt, "--steps", str(args.steps), "--cfg",
                                   str(args.cfg), "--seed", str(1000 + i), *how, "--out-dir", out],
                                  check=True, capture_output=True, text=True).stdout
            m = re.search(r"PSNR ([\d.inf]+) dB, SSIM ([\d.]+), latents relative L2 ([\d.e-]+)", text)
            found = re.search(r'"rounds":(\d+)', text)  # none for fp8: the plain loop reports no strategy
            rounds = int(found.group(1)) if found else args.steps
            # The denoiser's speed-up: steps over sequential rounds, or over a step cache's model work.
            work = re.search(r'"model_work":([\d.e+-]+)', text)
            speedup = args.steps / (float(work.group(1)) if work else rounds)
            results[(name, n)].append((float(m.group(1)), float(m.group(2)), float(m.group(3)), rounds, speedup))
            if i == 0:
                if not sheet:
                    sheet.append(("baseline", Image.open(os.path.join(out, "baseline.png")).convert("RGB")))
                png = "single.png" if name == "fp8" else f"{name}.png"
                sheet.append((f"{name}:{n}", Image.open(os.path.join(out, png)).convert("RGB")))
        print(f"{i + 1}/{len(rows)} {prompt}", flush=True)

lines = ["# Strategy quality on diffract-emoji", "",
         f"`scripts/quality_report.py`: `diffract-cli compare` on the shipped model for the first {len(rows)} held-out "
         f"prompts (seed 1000 + index, {args.steps} Euler steps, CFG {args.cfg}, 128²), each strategy against the "
         "one-device baseline of the same seed. CPU virtual devices: the images are the ones GPUs would make (up to "
         "rounding); speed is measured on GPUs in `docs/benchmarks.md`. A round is one sequential model evaluation; "
         "AsyncDiff's are one UNet component each (about 1/n of the UNet), so its 30 rounds cost about 30 / n "
         "evaluations. The step caches' speed-up is the steps over the model work they "
         "ran (`model_work`: full evaluations' worth, a reused step counted at the share of the UNet's estimated "
         "multiply-adds it still ran), the others' the steps over their rounds; step-skip:N, deepcache:N take "
         "--skip N, fbcache:X --cache-threshold X (the first down layer and DeepCache's shallow path every step, "
         "the deep layers refreshed when that layer's residual moved more than X); the caches keep the first 10 % "
         "of the steps in full (DIFFRACT_CACHE_WARMUP's default); their cfg- variants run each CFG branch on its own "
         "device, deciding on both branches' change. fp8:0 is the plain loop with e4m3 linear layers, "
         "emulated in fp32 on the CPU.", "",
         "| strategy | rounds (of 30) | denoiser speed-up mean (min..max) | PSNR mean / min (dB) | SSIM mean / min | "
         "latent rel-L2 mean / max |",
         "| --- | --- | --- | --- | --- | --- |"]
for (name, n), v in results.items():
    ps = [x[0] for x in v]
    ss = [x[1] for x in v]
    ls = [x[2] for x in v]
    us = [x[4] for x in v]
    lines.append(f"| {name}:{n} | {v[0][3]} | {statistics.mean(us):.2f}x ({min(us):.2f}..{max(us):.2f}) | "
                 f"{statistics.mean(ps):.1f} / {min(ps):.1f} | {statistics.mean(ss):.4f} / "
                 f"{min(ss):.4f} | {statistics.mean(ls):.4f} / {max(ls):.4f} |")
lines += ["", f"First prompt (`{caption(rows[0])}`), baseline then each strategy:", "", "![strategies](quality-emoji.png)", ""]
open(os.path.join(args.docs, "quality-emoji.md"), "w").write("\n".join(lines))

w = 128
img = Image.new("RGB", ((w + 4) * len(sheet), w + 16), "white")
d = ImageDraw.Draw(img)
for k, (label, im) in enumerate(sheet):
    img.paste(im.resize((w, w)), (k * (w + 4), 16))
    d.text((k * (w + 4) + 2, 2), label, fill="black")
img.save(os.path.join(args.docs, "quality-emoji.png"))
print("wrote", os.path.join(args.docs, "quality-emoji.md"))
