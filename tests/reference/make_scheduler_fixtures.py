#!/usr/bin/env python3
"""Reference oracle for the samplers: diffusers' schedulers run on a fake model.

Writes into --out only: one scheduler_config.json per case, the trajectory of every case
(timesteps, sigmas, the sample after each step, the predicted x0) as safetensors, DDIM / DDPM
jump references from the closed forms, timesteps / sigmas over many step counts, and the
config diffusers resolves from real-looking model folders. CPU, a few seconds.
"""
import argparse
import inspect
import json
import math
import os

import numpy as np
import torch
from diffusers import (DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler,
                       EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler)
from safetensors.torch import save_file

torch.set_grad_enabled(False)

# Our sampler names and the diffusers class each stands for (+ the from_config override).
KINDS = {
    "euler": (EulerDiscreteScheduler, {}),
    "euler-ancestral": (EulerAncestralDiscreteScheduler, {}),
    "ddim": (DDIMScheduler, {}),
    "ddpm": (DDPMScheduler, {}),
    "dpmpp-2m": (DPMSolverMultistepScheduler, {}),
    "dpmpp-2m-karras": (DPMSolverMultistepScheduler, {"use_karras_sigmas": True}),
}
SPACINGS = ["leading", "trailing", "linspace"]
PREDICTIONS = ["epsilon", "v_prediction"]
SD = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "num_train_timesteps": 1000,
      "steps_offset": 1, "set_alpha_to_one": False, "clip_sample": False}
LINEAR = {"beta_schedule": "linear", "num_train_timesteps": 1000}  # everything else: the class defaults
COSINE = {"beta_schedule": "squaredcos_cap_v2", "num_train_timesteps": 1000}
SHAPE = (1, 4, 8, 8)

# SD 1.5's scheduler_config.json as published, and a few other real-looking ones.
REAL = {
    "sd15": {"_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", "beta_end": 0.012,
             "beta_schedule": "scaled_linear", "beta_start": 0.00085, "num_train_timesteps": 1000,
             "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None,
             "clip_sample": False},
    "sdxl": {"_class_name": "EulerDiscreteScheduler", "_diffusers_version": "0.19.0.dev0", "beta_end": 0.012,
             "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
             "interpolation_type": "linear", "num_train_timesteps": 1000, "prediction_type": "epsilon",
             "sample_max_value": 1.0, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
             "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False},
    "sd21v": {"_class_name": "DDIMScheduler", "_diffusers_version": "0.8.0", "beta_end": 0.012,
              "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
              "num_train_timesteps": 1000, "prediction_type": "v_prediction", "set_alpha_to_one": False,
              "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None},
    "dpm_karras": {"_class_name": "DPMSolverMultistepScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
                   "beta_start": 0.00085, "num_train_timesteps": 1000, "steps_offset": 1,
                   "use_karras_sigmas": True, "timestep_spacing": "trailing", "lower_order_final": False,
                   "final_sigmas_type": "sigma_min", "sigma_min": 0.05, "sigma_max": 10.0},
    "lms": {"_class_name": "LMSDiscreteScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
            "beta_start": 0.00085, "num_train_timesteps": 1000, "steps_offset": 1},
}

# Config keys the C++ SchedulerConfig mirrors; the oracle reports diffusers' resolved value of each.
RESOLVED_KEYS = ["num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "prediction_type",
                 "timestep_spacing", "steps_offset", "set_alpha_to_one", "clip_sample", "clip_sample_range",
                 "variance_type", "use_karras_sigmas", "sigma_min", "sigma_max", "final_sigmas_type",
                 "lower_order_final", "euler_at_final", "solver_type", "lambda_min_clipped",
                 "rescale_betas_zero_snr", "interpolation_type", "timestep_type", "thresholding",
                 "solver_order", "algorithm_type"]


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, allow_nan=False)


def jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "inf" if v > 0 else "-inf"
    return v


def make_scheduler(kind, cfg):
    cls, extra = KINDS[kind]
    return cls.from_config(cfg, **extra)


def fake_model(sched, x, t):
    # Easy to reproduce in C++: a float32 affine map of the scaled input plus a timestep term.
    return 0.3 * sched.scale_model_input(x, t) + 0.05 * (float(t) / 1000.0)


def run_case(out_tensors, name, kind, cfg, steps, seed):
    sched = make_scheduler(kind, cfg)
    sched.set_timesteps(steps)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) * sched.init_noise_sigma
    g = torch.Generator().manual_seed(seed + 1)
    xs, x0s = [x], []
    for t in sched.timesteps:
        mo = fake_model(sched, x, t)
        res = sched.step(mo, t, x, generator=g)
        x0s.append(res.pred_original_sample if kind not in ("dpmpp-2m", "dpmpp-2m-karras") else sched.model_outputs[-1])
        x = res.prev_sample
        xs.append(x)
    out_tensors[name + ".timesteps"] = sched.timesteps.double()
    if kind in ("euler", "euler-ancestral", "dpmpp-2m", "dpmpp-2m-karras"):
        out_tensors[name + ".sigmas"] = sched.sigmas.float().contiguous()
    out_tensors[name + ".x"] = torch.stack(xs).contiguous()
    out_tensors[name + ".x0"] = torch.stack(x0s).contiguous()
    return {"name": name, "kind": kind, "steps": steps, "seed": seed, "num_steps": len(sched.timesteps),
            "init_noise_sigma": float(sched.init_noise_sigma)}


def make_trajectories(out):
    cases, tensors = [], {}
    cfg_dir = os.path.join(out, "configs")
    os.makedirs(cfg_dir, exist_ok=True)
    seed = 100

    def add(name, kind, cfg, steps):
        nonlocal seed
        seed += 2
        full = {"_class_name": KINDS[kind][0].__name__, **cfg}
        write_json(os.path.join(cfg_dir, name + ".json"), full)
        cases.append(run_case(tensors, name, kind, full, steps, seed))

    for kind in KINDS:
        for spacing in SPACINGS:
            for pred in PREDICTIONS:
                for base_name, base, step_counts in (("sd", SD, (10, 25)), ("linear", LINEAR, (10, 25)),
                                                     ("cosine", COSINE, (10,))):
                    if base is COSINE and kind == "dpmpp-2m-karras":
                        continue  # diffusers' Karras timesteps repeat 998 here and its step index runs off the end
                    for steps in step_counts:
                        cfg = {**base, "timestep_spacing": spacing, "prediction_type": pred}
                        add(f"{kind}.{base_name}.{spacing}.{pred}.{steps}", kind, cfg, steps)

    # Options away from the defaults.
    sd = {**SD, "timestep_spacing": "leading"}
    add("euler.karras", "euler", {**sd, "use_karras_sigmas": True}, 12)
    add("euler.karras_minmax", "euler", {**SD, "use_karras_sigmas": True, "sigma_min": 0.1, "sigma_max": 8.0,
                                         "timestep_spacing": "trailing"}, 12)
    add("euler.sigma_min", "euler", {**sd, "final_sigmas_type": "sigma_min"}, 10)
    add("euler.trained_betas", "euler", {"trained_betas": [0.0005 + 0.0001 * i for i in range(100)],
                                         "num_train_timesteps": 100}, 8)
    zsnr = {**SD, "rescale_betas_zero_snr": True, "timestep_spacing": "trailing", "prediction_type": "v_prediction"}
    add("euler.zsnr", "euler", zsnr, 10)
    add("euler-ancestral.zsnr", "euler-ancestral", zsnr, 10)
    add("ddim.zsnr", "ddim", zsnr, 10)
    add("ddim.alpha_one_clip", "ddim", {**SD, "set_alpha_to_one": True, "clip_sample": True,
                                        "clip_sample_range": 0.5}, 10)
    add("ddpm.fixed_large", "ddpm", {**SD, "variance_type": "fixed_large"}, 10)
    add("ddpm.fixed_small_log", "ddpm", {**SD, "variance_type": "fixed_small_log", "clip_sample": True}, 10)
    add("ddpm.offset0", "ddpm", {**SD, "steps_offset": 0}, 10)
    add("dpmpp-2m.heun", "dpmpp-2m", {**sd, "solver_type": "heun"}, 10)
    add("dpmpp-2m.no_lower_final", "dpmpp-2m", {**sd, "lower_order_final": False, "final_sigmas_type": "sigma_min"}, 10)
    add("dpmpp-2m.sigma_min_long", "dpmpp-2m", {**sd, "final_sigmas_type": "sigma_min"}, 20)
    add("dpmpp-2m.euler_at_final", "dpmpp-2m", {**sd, "euler_at_final": True, "final_sigmas_type": "sigma_min"}, 20)
    add("dpmpp-2m.lambda_clip", "dpmpp-2m", {**SD, "lambda_min_clipped": -5.1, "timestep_spacing": "linspace"}, 10)
    add("dpmpp-2m-karras.minmax", "dpmpp-2m-karras", {**sd, "sigma_min": 0.05, "sigma_max": 10.0}, 15)
    add("dpmpp-2m-karras.long", "dpmpp-2m-karras", {**sd}, 30)

    save_file(tensors, os.path.join(out, "trajectories.safetensors"))
    return cases, tensors


# --- flow matching (SD3): FlowMatchEulerDiscreteScheduler on a fake velocity model ------------
SD3_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.29.0.dev0",
                 "num_train_timesteps": 1000, "shift": 3.0}


FLUX_DEV_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256,
                      "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000,
                      "shift": 3.0, "use_dynamic_shifting": True}
FLUX_SCHNELL_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
                          "shift": 1.0, "use_dynamic_shifting": False}


def calculate_shift(seq, base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15):
    """diffusers' FluxPipeline calculate_shift, with the scheduler config's defaults."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return seq * m + base_shift - m * base_seq_len


def flow_model(x, t):
    return 0.3 * x + 0.05 * (float(t) / 1000.0)


def make_flow(out, cases, tensors):
    cfg_dir = os.path.join(out, "configs")
    seed = 900
    for name, cfg, steps in (("flow-euler.sd3.28", SD3_SCHEDULER, 28), ("flow-euler.sd3.4", SD3_SCHEDULER, 4),
                             ("flow-euler.sd3.1", SD3_SCHEDULER, 1),
                             ("flow-euler.shift1.10", {"_class_name": "FlowMatchEulerDiscreteScheduler"}, 10),
                             ("flow-euler.t100.7", {"_class_name": "FlowMatchEulerDiscreteScheduler",
                                                    "num_train_timesteps": 100, "shift": 2.5}, 7)):
        seed += 2
        write_json(os.path.join(cfg_dir, name + ".json"), cfg)
        sched = FlowMatchEulerDiscreteScheduler.from_config(cfg)
        sched.set_timesteps(steps)
        # The SD3 pipeline starts from unit noise (the scheduler has no init_noise_sigma).
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
        xs, x0s = [x], []
        for i, t in enumerate(sched.timesteps):
            v = flow_model(x, t)
            x0s.append(x - sched.sigmas[i] * v)
            x = sched.step(v, t, x).prev_sample
            xs.append(x)
        tensors[name + ".timesteps"] = sched.timesteps.double()
        tensors[name + ".sigmas"] = sched.sigmas.float().contiguous()
        tensors[name + ".x"] = torch.stack(xs).contiguous()
        tensors[name + ".x0"] = torch.stack(x0s).contiguous()
        cases.append({"name": name, "kind": "flow-euler", "steps": steps, "seed": seed, "num_steps": len(sched.timesteps),
                      "init_noise_sigma": 1.0})
    save_file(tensors, os.path.join(out, "trajectories.safetensors"))

    # Sigmas and timesteps over step counts and shifts.
    counts = list(range(1, 61)) + [75, 100, 150, 333, 1000]
    shifts = [1.0, 3.0, 0.5, 6.0]
    st = {}
    for shift in shifts:
        for n in counts:
            sched = FlowMatchEulerDiscreteScheduler(shift=shift)
            sched.set_timesteps(n)
            st[f"flow-euler.{shift}.{n}.timesteps"] = sched.timesteps.double()
            st[f"flow-euler.{shift}.{n}.sigmas"] = sched.sigmas.float().contiguous()
    # Flux: the pipeline's np.linspace(1, 1/n, n) sigmas with the resolution-dependent shift (dev)
    # or without (schnell, shift 1), and SD3's training schedule under a time shift.
    flux = []
    for n in [1, 2, 4, 20, 28, 50]:
        for seq in [256, 1024, 4096, 6144, 64]:
            sigmas = np.linspace(1.0, 1 / n, n)
            for name, cfg, given in (("dev", FLUX_DEV_SCHEDULER, True), ("schnell", FLUX_SCHNELL_SCHEDULER, True),
                                     ("linear", dict(FLUX_DEV_SCHEDULER, time_shift_type="linear"), True),
                                     ("training", FLUX_DEV_SCHEDULER, False)):
                if name == "schnell" and seq != 1024:
                    continue
                sched = FlowMatchEulerDiscreteScheduler.from_config(cfg)
                mu = calculate_shift(seq) if cfg.get("use_dynamic_shifting") else None
                if given:
                    sched.set_timesteps(sigmas=sigmas, mu=mu)
                else:
                    sched.set_timesteps(n, mu=mu)
                key = f"flux.{name}.{n}.{seq}"
                st[key + ".timesteps"] = sched.timesteps.double()
                st[key + ".sigmas"] = sched.sigmas.float().contiguous()
                flux.append({"key": key, "config": cfg, "steps": n, "image_seq_len": seq, "linear_sigmas": given,
                             "mu": mu})
    write_json(os.path.join(out, "flux_schedules.json"), flux)
    save_file(st, os.path.join(out, "flow_sweep.safetensors"))
    d = os.path.join(out, "real", "sd3")
    os.makedirs(d, exist_ok=True)
    write_json(os.path.join(d, "scheduler_config.json"), SD3_SCHEDULER)
    return {"counts": counts, "shifts": shifts}


# --- jumps: closed forms from alphas_cumprod, written independently of the schedulers ---------
def make_jumps(out, tensors):
    jumps, jt = [], {}
    for kind in ("ddim", "ddpm"):
        for base_name in ("sd", "linear"):
            for pred in PREDICTIONS:
                case = f"{kind}.{base_name}.leading.{pred}.10"
                cfg = json.load(open(os.path.join(out, "configs", case + ".json")))
                sched = make_scheduler(kind, cfg)
                sched.set_timesteps(10)
                c = sched.config
                ac = sched.alphas_cumprod.double()
                ts = [int(t) for t in sched.timesteps]
                n = len(ts)
                # Where the last step lands: DDIM's final_alpha_cumprod, DDPM's alpha of 1.
                final = 1.0 if (kind == "ddpm" or c.set_alpha_to_one) else float(ac[0])
                for (i, j) in ((0, 1), (0, 4), (2, 7), (3, n), (n - 1, n), (0, n)):
                    xf = tensors[case + ".x"][i]
                    t = ts[i]
                    mo = (0.3 * xf + 0.05 * (t / 1000.0)).double()  # the fake model (no input scaling)
                    x = xf.double()
                    a_i = float(ac[t])
                    a_j = float(ac[ts[j]]) if j < n else final
                    if c.prediction_type == "epsilon":
                        x0 = (x - math.sqrt(1 - a_i) * mo) / math.sqrt(a_i)
                        eps = mo
                    else:
                        x0 = math.sqrt(a_i) * x - math.sqrt(1 - a_i) * mo
                        eps = math.sqrt(a_i) * mo + math.sqrt(1 - a_i) * x
                    if c.clip_sample:
                        x0 = x0.clamp(-c.clip_sample_range, c.clip_sample_range)
                    seed = 7000 + len(jumps)
                    if kind == "ddim":
                        xj = math.sqrt(a_j) * x0 + math.sqrt(1 - a_j) * eps
                    else:
                        # Posterior q(x_j | x_i, x0) of the forward process between t_i and t_j.
                        a_ij = a_i / a_j
                        mean = ((math.sqrt(a_j) * (1 - a_ij) / (1 - a_i)) * x0
                                + (math.sqrt(a_ij) * (1 - a_j) / (1 - a_i)) * x)
                        var = max((1 - a_j) / (1 - a_i) * (1 - a_ij), 1e-20)
                        noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).double()
                        xj = mean + (math.sqrt(var) * noise if t > 0 else 0.0)
                    key = f"jump.{case}.{i}.{j}"
                    jt[key] = xj.float().contiguous()
                    jumps.append({"key": key, "case": case, "i": i, "j": j, "seed": seed})
    save_file(jt, os.path.join(out, "jumps.safetensors"))
    return jumps


# --- timesteps and sigmas over many step counts --------------------------------------------------
def make_sweep(out):
    counts = list(range(1, 61)) + [61, 75, 99, 100, 103, 150, 250, 333, 500, 999, 1000]
    st, uneven = {}, []
    for kind in KINDS:
        for spacing in SPACINGS:
            cfg = {"_class_name": KINDS[kind][0].__name__, **SD, "timestep_spacing": spacing}
            for n in counts:
                sched = make_scheduler(kind, cfg)
                sched.set_timesteps(n)
                key = f"{kind}.{spacing}.{n}"
                st[key + ".timesteps"] = sched.timesteps.double()
                if hasattr(sched, "sigmas") and kind not in ("ddim", "ddpm"):
                    st[key + ".sigmas"] = sched.sigmas.float().contiguous()
                if len(sched.timesteps) != n:
                    uneven.append(key)
    save_file(st, os.path.join(out, "sweep.safetensors"))
    return {"counts": counts, "uneven": uneven}


def make_resolved(out):
    resolved = {}
    for name, cfg in REAL.items():
        d = os.path.join(out, "real", name)
        os.makedirs(d, exist_ok=True)
        write_json(os.path.join(d, "scheduler_config.json"), cfg)
        resolved[name] = {}
        for kind in KINDS:
            own = inspect.signature(KINDS[kind][0].__init__).parameters  # from_config keeps foreign keys too
            c = make_scheduler(kind, cfg).config
            resolved[name][kind] = {k: jsonable(c[k]) for k in RESOLVED_KEYS if k in own}
    return resolved


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cases, tensors = make_trajectories(args.out)
    jumps = make_jumps(args.out, tensors)
    flow_sweep = make_flow(args.out, cases, tensors)
    sweep = make_sweep(args.out)
    resolved = make_resolved(args.out)
    write_json(os.path.join(args.out, "index.json"),
               {"shape": list(SHAPE), "cases": cases, "jumps": jumps, "sweep": sweep, "resolved": resolved,
                "flow_sweep": flow_sweep})


if __name__ == "__main__":
    main()
