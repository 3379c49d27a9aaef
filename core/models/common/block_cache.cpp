#include "core/models/common/block_cache.h"

#include <ATen/ATen.h>

namespace diffract::models {

double relative_change(const at::Tensor& now, const at::Tensor& then) {
  const auto t = then.to(at::kFloat);
  return ((now.to(at::kFloat) - t).abs().mean() / t.abs().mean()).item<double>();
}

double StepCache::change(const at::Tensor& now, const at::Tensor& then) const {
  if (!combine) return relative_change(now, then);
  const auto t = then.to(at::kFloat);
  const auto sums = at::stack({(now.to(at::kFloat) - t).abs().sum(), t.abs().sum()}).to(at::kCPU, at::kDouble);
  double changed = sums[0].item<double>(), total = sums[1].item<double>();  // one read from the device
  combine(changed, total);  // the whole batch's sums: their ratio is its ratio of means, whatever the shares
  return changed / total;
}

bool FirstBlockCache::can_reuse(const at::Tensor& now) const {
  if (threshold <= 0 || step < warmup || !first_residual.defined() || !rest_residual.defined() ||
      first_residual.sizes() != now.sizes())
    return false;
  return change(now, first_residual) < threshold;
}

std::vector<double> TeaCache::identity() { return {1.0, 0.0}; }

std::vector<double> TeaCache::flux() { return {4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00, 2.64230861e-01}; }

bool TeaCache::can_reuse(const at::Tensor& modulated) {
  const bool edge = step == 0 || step < warmup || step >= steps - 1;
  const bool comparable = previous.defined() && previous.sizes() == modulated.sizes() && residual.defined();
  bool reuse = false;
  if (!edge && comparable && threshold > 0) {
    const double x = change(modulated, previous);
    double rescaled = 0;
    for (double c : coefficients) rescaled = rescaled * x + c;
    accumulated += rescaled;
    reuse = accumulated < threshold;
  }
  if (!reuse) accumulated = 0;
  previous = modulated;
  return reuse;
}

bool DeepCache::full_step(const at::Tensor& first_now) const {
  if (step == 0 || step < warmup || !deep.defined()) return true;
  if (threshold < 0) return interval <= 1 || step % interval == 0;
  if (threshold == 0 || !first.defined() || first.sizes() != first_now.sizes()) return true;
  return change(first_now, first) >= threshold;
}

void ImageKV::write(at::Tensor& keys, at::Tensor& values, int64_t begin) {
  const int64_t n = keys.size(1);
  if (!k.defined() || k.size(1) == n) {
    TORCH_CHECK(begin == 0, "an empty image K/V cache is filled by a pass over the whole image");
    k = keys.contiguous();
    v = values.contiguous();
  } else {
    k.narrow(1, begin, n).copy_(keys);
    v.narrow(1, begin, n).copy_(values);
  }
  keys = k;
  values = v;
}

}  // namespace diffract::models
