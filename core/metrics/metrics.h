#pragma once
// Image and latent quality metrics for comparing an accelerated run with its baseline.
#include <ATen/core/Tensor.h>

#include "core/io/image.h"

namespace diffract::metrics {

// Images are [C, H, W] or [H, W, C] per `channels_last`, any real dtype; computed in float64.
// PSNR in dB: 10 log10(data_range^2 / MSE); +inf for equal images.
double psnr(const at::Tensor& a, const at::Tensor& b, double data_range, bool channels_last = false);
// SSIM as Wang et al. 2004 and scikit-image's structural_similarity(gaussian_weights=True,
// sigma=1.5, use_sample_covariance=False, K1=0.01, K2=0.03, data_range=...): an 11x11 gaussian
// window, the map averaged over the pixels at least 5 from the border, then over channels.
// Images need at least 11 pixels a side.
double ssim(const at::Tensor& a, const at::Tensor& b, double data_range, bool channels_last = false);
// 8-bit RGB images (data_range 255).
double psnr(const io::Image& a, const io::Image& b);
double ssim(const io::Image& a, const io::Image& b);
// ||a - b|| / ||b|| (Frobenius; 0 when both are zero).
double relative_l2(const at::Tensor& a, const at::Tensor& b);
// mean|a - b| / mean|b|.
double rel_mae(const at::Tensor& a, const at::Tensor& b);
// |a - b| averaged over channels, [H, W] float, for a difference heatmap.
at::Tensor abs_diff_map(const io::Image& a, const io::Image& b);

}  // namespace diffract::metrics
