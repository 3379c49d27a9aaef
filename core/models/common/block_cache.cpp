#include "core/models/common/block_cache.h"

#include <ATen/ATen.h>

namespace diffract::models {

bool FirstBlockCache::can_reuse(const at::Tensor& now) const {
  if (threshold <= 0 || !first_residual.defined() || !rest_residual.defined() || first_residual.sizes() != now.sizes())
    return false;
  const auto then = first_residual.to(at::kFloat);
  const double change = ((now.to(at::kFloat) - then).abs().mean() / then.abs().mean()).item<double>();
  return change < threshold;
}

}  // namespace diffract::models
