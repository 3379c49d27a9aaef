#!/usr/bin/env python3
"""Reference oracle for DeepCache: horseee/DeepCache's DeepCacheSDHelper (the DeepCache package,
which wraps the pipeline's UNet blocks and returns their cached outputs on the steps it skips) over
diffusers' SD and SDXL pipelines with make_fixtures.py's tiny-sd / tiny-sdxl (--fixtures): the
final latents of text-to-image runs for several (cache_branch_id, cache_interval), which the
deepcache strategy must reproduce (DIFFRACT_DEEPCACHE_BRANCH, --skip).

Writes into --out: deepcache_cases.json (each run's settings) and deepcache_cases.safetensors (its
final latents, output_type="latent", and the same run without DeepCache). CPU, seconds.
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file

torch.set_grad_enabled(False)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from DeepCache import DeepCacheSDHelper
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    pipes = {"tiny-sd": StableDiffusionPipeline.from_pretrained(os.path.join(args.fixtures, "tiny-sd")),
             "tiny-sdxl": StableDiffusionXLPipeline.from_pretrained(os.path.join(args.fixtures, "tiny-sdxl"))}
    for p in pipes.values():
        p.scheduler = EulerDiscreteScheduler.from_config(p.scheduler.config)
        p.set_progress_bar_config(disable=True)

    # tiny-sd and tiny-sdxl: two down blocks of two resnets, the first with a downsampler: five
    # down layers, so branches 0..5 (DeepCache numbers them block * 3 + layer, as ours for this layout).
    runs = [("tiny-sd", 0, 3, 31), ("tiny-sd", 1, 2, 32), ("tiny-sd", 2, 3, 33), ("tiny-sd", 3, 2, 34),
            ("tiny-sd", 5, 4, 35), ("tiny-sdxl", 0, 3, 36), ("tiny-sdxl", 2, 2, 37)]
    tensors, cases = {}, []
    for model, branch, interval, seed in runs:
        pipe = pipes[model]
        kw = dict(prompt="a glass bottle of perfume on white", negative_prompt="blurry", num_inference_steps=7,
                  guidance_scale=6.0, height=64, width=64, output_type="latent")
        plain = pipe(generator=torch.Generator().manual_seed(seed), **kw).images
        helper = DeepCacheSDHelper(pipe=pipe)
        helper.set_params(cache_interval=interval, cache_branch_id=branch)
        helper.enable()
        cached = pipe(generator=torch.Generator().manual_seed(seed), **kw).images
        helper.disable()
        name = f"{model}.branch{branch}.interval{interval}"
        assert not torch.equal(plain, cached), name + ": DeepCache changed nothing"
        tensors[name] = cached.contiguous()
        tensors[name + ".plain"] = plain.contiguous()
        cases.append({"name": name, "model": model, "branch": branch, "interval": interval, "seed": seed,
                      **{k: v for k, v in kw.items() if k != "output_type"}})
    save_file(tensors, os.path.join(args.out, "deepcache_cases.safetensors"))
    with open(os.path.join(args.out, "deepcache_cases.json"), "w") as f:
        json.dump(cases, f, indent=1)


if __name__ == "__main__":
    main()
