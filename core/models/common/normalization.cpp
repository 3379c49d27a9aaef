#include "core/models/common/normalization.h"

#include <utility>

#include <ATen/ATen.h>

#include "core/models/common/layer_norm.h"

namespace diffract::models {

namespace {
constexpr double kEps = 1e-6;
}  // namespace

RMSNormImpl::RMSNormImpl(int64_t dim, double e) : eps(e) { weight = register_parameter("weight", at::ones({dim})); }

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  // [..., dim] -> [..., dim]
  // As diffusers' RMSNorm: statistics in float32, the scale applied in the weight's dtype when
  // that is half precision.
  const auto xf = x.to(at::kFloat);
  auto y = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  if (weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16) y = y.to(weight.scalar_type());
  return (y * weight).to(x.scalar_type());
}

AdaLayerNormZeroImpl::AdaLayerNormZeroImpl(int64_t dim, bool d) : dual(d) {
  linear = register_module("linear", Linear(dim, (dual ? 9 : 6) * dim));
}

AdaNormZeroOut AdaLayerNormZeroImpl::forward(const at::Tensor& x, const at::Tensor& temb) {
  // x [B, T, D], temb [B, D] -> modulated x [B, T, D] (and x2), gates / shifts / scales [B, D]
  const auto m = linear->forward(at::silu(temb)).chunk(dual ? 9 : 6, 1);
  AdaNormZeroOut o;
  o.gate_msa = m[2];
  o.shift_mlp = m[3];
  o.scale_mlp = m[4];
  o.gate_mlp = m[5];
  if (dual) {
    auto both = modulated_layer_norms(x, {{m[1], m[0]}, {m[7], m[6]}}, kEps);
    o.x = std::move(both[0]);
    o.x2 = std::move(both[1]);
    o.gate_msa2 = m[8];
  } else {
    o.x = modulated_layer_norm(x, m[1], m[0], kEps);
  }
  return o;
}

AdaLayerNormContinuousImpl::AdaLayerNormContinuousImpl(int64_t dim, int64_t conditioning_dim) {
  linear = register_module("linear", Linear(conditioning_dim, 2 * dim));
}

at::Tensor AdaLayerNormContinuousImpl::forward(const at::Tensor& x, const at::Tensor& cond) {
  // x [B, T, D], cond [B, C] -> [B, T, D]
  const auto m = linear->forward(at::silu(cond).to(x.scalar_type())).chunk(2, 1);  // scale, shift
  return modulated_layer_norm(x, m[0], m[1], kEps);
}

AdaLayerNormZeroSingleImpl::AdaLayerNormZeroSingleImpl(int64_t dim) {
  linear = register_module("linear", Linear(dim, 3 * dim));
}

AdaNormZeroSingleOut AdaLayerNormZeroSingleImpl::forward(const at::Tensor& x, const at::Tensor& temb) {
  // x [B, T, D], temb [B, D] -> modulated x [B, T, D], gate [B, D]
  const auto m = linear->forward(at::silu(temb)).chunk(3, 1);
  return {modulated_layer_norm(x, m[1], m[0], kEps), m[2]};
}

}  // namespace diffract::models
