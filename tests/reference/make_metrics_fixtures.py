#!/usr/bin/env python3
"""Oracle for core/metrics: PSNR and SSIM from scikit-image on seeded 8-bit RGB images.

Writes metrics_cases.json: [{name, height, width, a: [...], b: [...], psnr, ssim}], the images
as flat H*W*3 uint8 lists (row-major, channels last).
"""
import argparse
import json
import pathlib

import numpy as np
from skimage.metrics import peak_signal_noise_ratio, structural_similarity


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1234)
    cases = []

    def add(name, a, b):
        cases.append({
            "name": name, "height": int(a.shape[0]), "width": int(a.shape[1]),
            "a": a.reshape(-1).tolist(), "b": b.reshape(-1).tolist(),
            "psnr": float(peak_signal_noise_ratio(a, b, data_range=255)),
            "ssim": float(structural_similarity(a, b, data_range=255, channel_axis=2, gaussian_weights=True,
                                                sigma=1.5, use_sample_covariance=False)),
        })

    a = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
    add("noise_vs_noise", a, rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
    b = np.clip(a.astype(np.int32) + rng.integers(-12, 13, a.shape), 0, 255).astype(np.uint8)
    add("noise_perturbed", a, b)
    y, x = np.mgrid[0:40, 0:36]
    smooth = np.stack([(x * 7) % 256, (y * 6) % 256, ((x + y) * 3) % 256], axis=2).astype(np.uint8)
    add("gradient_perturbed", smooth,
        np.clip(smooth.astype(np.int32) + rng.integers(-30, 31, smooth.shape), 0, 255).astype(np.uint8))
    (out / "metrics_cases.json").write_text(json.dumps(cases))
    print(f"wrote {len(cases)} metric cases to {out}")


if __name__ == "__main__":
    main()
