#pragma once
// The normalisations of diffusers' normalization.py the transformers share (SD3's MMDiT, Flux):
// RMSNorm and the adaptive layer norms that modulate by the timestep embedding. Every LayerNorm
// here has no parameters and eps 1e-6; the modulation itself is layer_norm.h's
// modulated_layer_norm (a kernel of our own on CUDA).
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "core/models/common/layers.h"

namespace diffract::models {

// RMSNorm over the last dimension with a learned scale ("weight"), computed in float32.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);  // [..., dim] -> [..., dim]
  double eps;
  at::Tensor weight;
};
TORCH_MODULE(RMSNorm);

// diffusers' AdaLayerNormZero (6 chunks) and SD35AdaLayerNormZeroX (9 chunks, the second
// attention's shift / scale / gate): "linear" maps SiLU(temb) to the modulation; the LayerNorm
// has no parameters.
struct AdaNormZeroOut {
  at::Tensor x;                                  // norm(x) * (1 + scale_msa) + shift_msa
  at::Tensor gate_msa, shift_mlp, scale_mlp, gate_mlp;
  at::Tensor x2, gate_msa2;                      // SD35AdaLayerNormZeroX only
};

class AdaLayerNormZeroImpl : public torch::nn::Module {
 public:
  AdaLayerNormZeroImpl(int64_t dim, bool dual);
  AdaNormZeroOut forward(const at::Tensor& x, const at::Tensor& temb);  // x [B, T, D], temb [B, D]
  bool dual;
  Linear linear{nullptr};
};
TORCH_MODULE(AdaLayerNormZero);

// diffusers' AdaLayerNormContinuous (layer norm without affine): "linear" maps SiLU(cond) to
// (scale, shift), in that order.
class AdaLayerNormContinuousImpl : public torch::nn::Module {
 public:
  AdaLayerNormContinuousImpl(int64_t dim, int64_t conditioning_dim);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cond);  // x [B, T, D], cond [B, C] -> [B, T, D]
  Linear linear{nullptr};
};
TORCH_MODULE(AdaLayerNormContinuous);

// diffusers' AdaLayerNormZeroSingle (Flux's single-stream blocks): "linear" maps SiLU(temb) to
// (shift, scale, gate).
struct AdaNormZeroSingleOut {
  at::Tensor x;     // norm(x) * (1 + scale) + shift
  at::Tensor gate;  // [B, D]
};

class AdaLayerNormZeroSingleImpl : public torch::nn::Module {
 public:
  explicit AdaLayerNormZeroSingleImpl(int64_t dim);
  AdaNormZeroSingleOut forward(const at::Tensor& x, const at::Tensor& temb);  // x [B, T, D], temb [B, D]
  Linear linear{nullptr};
};
TORCH_MODULE(AdaLayerNormZeroSingle);

}  // namespace diffract::models
