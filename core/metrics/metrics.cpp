#include "core/metrics/metrics.h"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>

#include "core/util/error.h"

namespace diffract::metrics {

namespace {

at::Tensor chw(const at::Tensor& t, bool channels_last) {
  if (t.dim() == 2) return t.unsqueeze(0).to(at::kDouble);
  if (t.dim() != 3) throw Error("image metrics need [C, H, W] or [H, W, C] tensors, not " + std::to_string(t.dim()) + "-d");
  return (channels_last ? t.permute({2, 0, 1}) : t).to(at::kDouble).contiguous();
}

void same_shape(const at::Tensor& a, const at::Tensor& b, const char* what) {
  if (a.sizes() != b.sizes())
    throw Error(std::string(what) + ": shapes differ (" + c10::str(a.sizes()) + " vs " + c10::str(b.sizes()) + ")");
}

at::Tensor image_tensor(const io::Image& img) {
  if (img.rgb.size() != static_cast<std::size_t>(img.width) * img.height * 3) throw Error("image metrics: not an RGB image");
  return at::from_blob(const_cast<std::uint8_t*>(img.rgb.data()), {img.height, img.width, 3}, at::kByte).clone();
}

}  // namespace

double psnr(const at::Tensor& a, const at::Tensor& b, double data_range, bool channels_last) {
  same_shape(a, b, "PSNR");
  const double mse = (chw(a, channels_last) - chw(b, channels_last)).pow(2).mean().item<double>();
  if (mse == 0) return std::numeric_limits<double>::infinity();
  return 10.0 * std::log10(data_range * data_range / mse);
}

double ssim(const at::Tensor& a, const at::Tensor& b, double data_range, bool channels_last) {
  same_shape(a, b, "SSIM");
  auto x = chw(a, channels_last), y = chw(b, channels_last);
  const int64_t c = x.size(0);
  if (x.size(1) < 11 || x.size(2) < 11) throw Error("SSIM needs images of at least 11x11 pixels");
  // scipy.ndimage.gaussian_filter's kernel for sigma 1.5, truncate 3.5: radius 5.
  auto r = at::arange(-5, 6, at::kDouble);
  auto g1 = at::exp(-0.5 * r * r / (1.5 * 1.5));
  g1 = g1 / g1.sum();
  auto w = at::outer(g1, g1).view({1, 1, 11, 11}).repeat({c, 1, 1, 1});
  auto filt = [&](const at::Tensor& t) { return at::conv2d(t.unsqueeze(0), w, at::Tensor(), at::IntArrayRef{1}, at::IntArrayRef{0}, at::IntArrayRef{1}, c).squeeze(0); };
  const auto ux = filt(x), uy = filt(y);
  const auto vx = filt(x * x) - ux * ux, vy = filt(y * y) - uy * uy, vxy = filt(x * y) - ux * uy;
  const double c1 = std::pow(0.01 * data_range, 2), c2 = std::pow(0.03 * data_range, 2);
  const auto s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux * ux + uy * uy + c1) * (vx + vy + c2));
  return s.mean({1, 2}).mean().item<double>();
}

double psnr(const io::Image& a, const io::Image& b) { return psnr(image_tensor(a), image_tensor(b), 255.0, true); }
double ssim(const io::Image& a, const io::Image& b) { return ssim(image_tensor(a), image_tensor(b), 255.0, true); }

double relative_l2(const at::Tensor& a, const at::Tensor& b) {
  same_shape(a, b, "relative L2");
  const auto ad = a.to(at::kDouble), bd = b.to(at::kDouble);
  const double num = (ad - bd).norm().item<double>(), den = bd.norm().item<double>();
  if (den == 0) return num == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return num / den;
}

double rel_mae(const at::Tensor& a, const at::Tensor& b) {
  same_shape(a, b, "rel-MAE");
  const auto ad = a.to(at::kDouble), bd = b.to(at::kDouble);
  const double num = (ad - bd).abs().mean().item<double>(), den = bd.abs().mean().item<double>();
  if (den == 0) return num == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return num / den;
}

at::Tensor abs_diff_map(const io::Image& a, const io::Image& b) {
  auto x = image_tensor(a).to(at::kFloat), y = image_tensor(b).to(at::kFloat);
  same_shape(x, y, "difference map");
  return (x - y).abs().mean(2);
}

}  // namespace diffract::metrics
