"""What each approximate strategy costs in quality on the real embedded model (diffract-emoji):
`diffract-cli compare` for every multi-device strategy and step cache over held-out prompts (CPU
virtual devices: the images are what GPUs would make, the timings mean nothing), summarised in
docs/quality-emoji.md with a sheet of one prompt's images (docs/quality-emoji.png). The step caches
run at settings whose model work matches step skipping's and DRiffusion's speed-ups (1.5x, 2x,
3x), so that each is compared at equal speed.
The second part (docs/quality-fixed-seeds.md) does the same on fixed seeds for the transformers,
SD3 and Flux.1-dev, on the tiny seeded pipelines the parity tests have diffusers make
(build/default/fixtures, after `ctest -L parity`): TeaCache and First-Block Cache at thresholds
calibrated on the first seed to 1.5x, 2x and 3x, against step skipping and DRiffusion.

  .venv/bin/python scripts/quality_report.py [--cli build/default/app/diffract-cli] [--prompts 12]
      [--part all|emoji|fixed-seeds] [--fixtures build/default/fixtures]
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
ap.add_argument("--part", choices=["all", "emoji", "fixed-seeds"], default="all")
ap.add_argument("--fixtures", default="build/default/fixtures")
args = ap.parse_args()

# The hold-out file names the settings; the captions are spelled as diffract-train spells them.
rows = list(csv.DictReader(open(args.holdout), delimiter="\t"))[: args.prompts]


def caption(r):
    a = "an" if r["colour"][0] in "aeiou" else "a"
    return f"a {r['scale']} {r['name']} in the {r['position']} on {a} {r['colour']} background"


def compare(common, how, out):
    """diffract-cli compare with `common` (model, prompt, sizes, seed) and `how` (the strategy):
    (PSNR, SSIM, latents rel-L2, rounds, the denoiser's speed-up)."""
    text = subprocess.run([args.cli, "compare", *common, *how, "--out-dir", out],
                          check=True, capture_output=True, text=True).stdout
    m = re.search(r"PSNR ([\d.inf]+) dB, SSIM ([\d.]+), latents relative L2 ([\d.e-]+)", text)
    found = re.search(r'"rounds":(\d+)', text)  # none for fp8: the plain loop reports no strategy
    rounds = int(found.group(1)) if found else args.steps
    # The denoiser's speed-up: steps over sequential rounds, or over a step cache's model work.
    work = re.search(r'"model_work":([\d.e+-]+)', text)
    speedup = args.steps / (float(work.group(1)) if work else rounds)
    return float(m.group(1)), float(m.group(2)), float(m.group(3)), rounds, speedup


def row(label, v, rounds):
    ps, ss, ls, us = ([x[k] for x in v] for k in (0, 1, 2, 4))
    return (f"| {label} | {rounds} | {statistics.mean(us):.2f}x ({min(us):.2f}..{max(us):.2f}) | "
            f"{statistics.mean(ps):.1f} / {min(ps):.1f} | {statistics.mean(ss):.4f} / "
            f"{min(ss):.4f} | {statistics.mean(ls):.4f} / {max(ls):.4f} |")


def emoji_report():
    results = {s: [] for s in STRATEGIES}
    sheet = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, r in enumerate(rows):
            prompt = caption(r)
            for name, n in STRATEGIES:
                out = os.path.join(tmp, f"{i}-{name}-{n}")
                flag = "--skip" if name in SKIPS else "--cache-threshold" if name in THRESHOLDS else "--devices"
                # fp8: the plain loop with e4m3 linear layers (emulated on the CPU) against bf16.
                how = (["--strategy", "single", "--precision", "fp8"] if name == "fp8"
                       else ["--strategy", name, flag, str(n)])
                common = ["--prompt", prompt, "--steps", str(args.steps), "--cfg", str(args.cfg), "--seed", str(1000 + i)]
                results[(name, n)].append(compare(common, how, out))
                if i == 0:
                    if not sheet:
                        sheet.append(("baseline", Image.open(os.path.join(out, "baseline.png")).convert("RGB")))
                    png = "single.png" if name == "fp8" else f"{name}.png"
                    sheet.append((f"{name}:{n}", Image.open(os.path.join(out, png)).convert("RGB")))
            print(f"{i + 1}/{len(rows)} {prompt}", flush=True)

    lines = ["# Strategy quality on diffract-emoji", "",
             f"`scripts/quality_report.py`: `diffract-cli compare` on the shipped model for the first {len(rows)} "
             f"held-out prompts (seed 1000 + index, {args.steps} Euler steps, CFG {args.cfg}, 128²), each strategy "
             "against the one-device baseline of the same seed. CPU virtual devices: the images are the ones GPUs "
             "would make (up to rounding); speed is measured on GPUs in `docs/benchmarks.md`. A round is one "
             "sequential model evaluation; AsyncDiff's are one UNet component each (about 1/n of the UNet), so its 30 "
             "rounds cost about 30 / n evaluations. The step caches' speed-up is the steps over the model work they "
             "ran (`model_work`: full evaluations' worth, a reused step counted at the share of the UNet's estimated "
             "multiply-adds it still ran), the others' the steps over their rounds; step-skip:N, deepcache:N take "
             "--skip N, fbcache:X --cache-threshold X (the first down layer and DeepCache's shallow path every step, "
             "the deep layers refreshed when that layer's residual moved more than X); the caches keep the first 10 % "
             "of the steps in full (DIFFRACT_CACHE_WARMUP's default); their cfg- variants run each CFG branch on its "
             "own device, deciding on both branches' change. fp8:0 is the plain loop with e4m3 linear layers, "
             "emulated in fp32 on the CPU. TeaCache needs a transformer's timestep-modulated input, so it is in "
             "[quality-fixed-seeds.md](quality-fixed-seeds.md).", "",
             "| strategy | rounds (of 30) | denoiser speed-up mean (min..max) | PSNR mean / min (dB) | SSIM mean / min | "
             "latent rel-L2 mean / max |",
             "| --- | --- | --- | --- | --- | --- |"]
    for (name, n), v in results.items():
        lines.append(row(f"{name}:{n}", v, v[0][3]))
    lines += ["", f"First prompt (`{caption(rows[0])}`), baseline then each strategy:", "",
              "![strategies](quality-emoji.png)", ""]
    open(os.path.join(args.docs, "quality-emoji.md"), "w").write("\n".join(lines))

    w = 128
    img = Image.new("RGB", ((w + 4) * len(sheet), w + 16), "white")
    d = ImageDraw.Draw(img)
    for k, (label, im) in enumerate(sheet):
        img.paste(im.resize((w, w)), (k * (w + 4), 16))
        d.text((k * (w + 4) + 2, 2), label, fill="black")
    img.save(os.path.join(args.docs, "quality-emoji.png"))
    print("wrote", os.path.join(args.docs, "quality-emoji.md"))


# The transformers on fixed seeds: each model's compare arguments (64² keeps a CPU run short).
TRANSFORMERS = [("SD3", "sd3_pipeline/tiny-sd3", ["--cfg", "5"]),
                ("Flux.1-dev", "flux/tiny-flux-dev", ["--cfg", "1", "--guidance", "3.5"])]
# Fixed settings: rounds or model work set by the strategy, not by the pictures.
FIXED = [("step-skip", ["--skip", "2"]), ("step-skip", ["--skip", "3"]), ("driffusion", ["--devices", "2"]),
         ("driffusion-aggressive", ["--devices", "2"]), ("driffusion-aggressive", ["--devices", "4"])]
CALIBRATED = ["teacache", "fbcache"]
TARGETS = [1.5, 2.0, 3.0]


def calibrate(common, name, target, tmp):
    """The smallest threshold (to 3 %, between 1e-3 and 10, the largest the strategies take) whose
    speed-up on `common` reaches `target`; None where even 10 stays below it."""
    def speedup(t):
        return compare(common, ["--strategy", name, "--cache-threshold", f"{t:.6g}"], os.path.join(tmp, "cal"))[4]
    lo, hi = 1e-3, 10.0
    if speedup(hi) < target:
        return None
    while hi / lo > 1.03:
        mid = (lo * hi) ** 0.5
        if speedup(mid) >= target:
            hi = mid
        else:
            lo = mid
    return float(f"{hi:.3g}")


def fixed_seeds_report():
    lines = ["# Strategy quality on fixed seeds: SD3 and Flux.1-dev", "",
             f"`scripts/quality_report.py --part fixed-seeds`: `diffract-cli compare` on the tiny seeded pipelines "
             f"that diffusers makes for the parity tests (`{args.fixtures}`: SD3 with two joint blocks, Flux.1-dev "
             f"with two double- and three single-stream blocks, random weights), {len(rows)} prompts (the held-out "
             f"captions) with seed 1000 + index, {args.steps} flow-Euler steps at 64², each strategy against the "
             "one-device baseline of the same seed on CPU virtual devices. The caches' thresholds are calibrated on "
             "the first seed: the smallest reaching each speed-up (1.5×, 2×, 3×); their speed-up on every seed is "
             "the steps over the model work they ran (a reused step counted at the share of the model it still "
             "ran: TeaCache's input modulation, First-Block Cache's first block), the other strategies' the steps "
             "over their sequential rounds. Random weights do not move smoothly from step to step as a trained "
             "model does, and a First-Block Cache of a two-block model runs half of it every step (so it cannot "
             "reach 2× on SD3 here): these tables rank the strategies at equal speed on the same seeds, not the "
             "quality a trained model would show (the embedded model's report is "
             "[quality-emoji.md](quality-emoji.md)).", ""]
    for title, folder, extra in TRANSFORMERS:
        model = os.path.join(args.fixtures, folder)
        if not os.path.isdir(model):
            raise SystemExit(f"{model}: missing; run `ctest --preset default -L parity` first (it makes the fixtures)")
        base = ["--model", model, "--steps", str(args.steps), "--width", "64", "--height", "64", *extra]
        results = {}  # label -> one result per seed, or None for a speed-up no threshold reached
        at_speed = {}  # (cache, target) -> label
        with tempfile.TemporaryDirectory() as tmp:
            first = [*base, "--prompt", caption(rows[0]), "--seed", "1000"]
            runs = [(f"{name}:{how[1]}", ["--strategy", name, *how]) for name, how in FIXED]
            for name in CALIBRATED:
                for target in TARGETS:
                    t = calibrate(first, name, target, tmp)
                    print(f"{title} {name} {target}x: threshold {t}", flush=True)
                    if t is None:
                        runs.append((f"{name} for {target:g}x", None))
                    else:
                        at_speed[(name, target)] = f"{name}:{t:g} (for {target:g}x)"
                        runs.append((at_speed[(name, target)], ["--strategy", name, "--cache-threshold", f"{t:g}"]))
            for label, how in runs:
                results[label] = None if how is None else []
            for i, r in enumerate(rows):
                common = [*base, "--prompt", caption(r), "--seed", str(1000 + i)]
                for label, how in runs:
                    if how is not None:
                        results[label].append(compare(common, how, os.path.join(tmp, "run")))
                print(f"{title} {i + 1}/{len(rows)}", flush=True)
        lines += [f"## {title}", "",
                  f"| strategy | rounds (of {args.steps}) | denoiser speed-up mean (min..max) | PSNR mean / min (dB) | "
                  "SSIM mean / min | latent rel-L2 mean / max |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for label, v in results.items():
            lines.append(f"| {label} | not reached with a threshold up to 10 | | | | |" if v is None
                         else row(label, v, v[0][3]))
        # Each cache against step skipping at the speed-ups both reach (2x, 3x): mean PSNR.
        verdicts = []
        for name in CALIBRATED:
            for target in (2.0, 3.0):
                label = at_speed.get((name, target))
                if not label:
                    verdicts.append(f"{name} does not reach {target:g}×")
                    continue
                mine = statistics.mean(x[0] for x in results[label])
                skip = statistics.mean(x[0] for x in results[f"step-skip:{target:g}"])
                verdicts.append(f"{name} at {target:g}× {mine:.1f} dB against step skipping's {skip:.1f} dB "
                                f"({'better' if mine > skip else 'worse'})")
        lines += ["", "Against step skipping at equal speed (mean PSNR): " + "; ".join(verdicts) + ".", ""]
    open(os.path.join(args.docs, "quality-fixed-seeds.md"), "w").write("\n".join(lines))
    print("wrote", os.path.join(args.docs, "quality-fixed-seeds.md"))


if args.part in ("all", "emoji"):
    emoji_report()
if args.part in ("all", "fixed-seeds"):
    fixed_seeds_report()
