#pragma once
// LayerNorm over the last dimension with an affine weight and bias ("weight", "bias": ones and
// zeros until bound), as torch::nn::LayerNorm({dim}): the same parameter names, so checkpoint
// keys bind as they did. On CUDA, for fp16 / bf16 rows the kernel takes (layer_norm_kernels.h),
// one kernel of our own; elsewhere, and wherever autograd or autocast is in play, at::layer_norm.
// Where an fp8 GEMM will read a kernel's output (fp8_rows_wanted, fp8_linear.h), the kernel writes
// the output's e4m3 rows as well and offers them to it.
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace diffract::models {

struct LayerNormOptions {
  explicit LayerNormOptions(int64_t dim) : dim(dim) {}
  LayerNormOptions& eps(double e) { eps_ = e; return *this; }
  int64_t dim;
  double eps_ = 1e-5;
};

class LayerNormImpl : public torch::nn::Module {
 public:
  explicit LayerNormImpl(const LayerNormOptions& o);
  at::Tensor forward(const at::Tensor& x);  // [..., dim] -> the same shape, contiguous
  // x, residual [..., dim] -> {x + residual, forward(x + residual)} (add_layer_norm)
  std::pair<at::Tensor, at::Tensor> forward_add(const at::Tensor& x, const at::Tensor& residual);
  LayerNormOptions options;
  at::Tensor weight;  // [dim]
  at::Tensor bias;    // [dim]
};
TORCH_MODULE(LayerNorm);

// at::layer_norm(x, {x.size(-1)}, weight, bias, eps), through the kernel where it applies.
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps);
// {x + residual, layer_norm(x + residual, ...)}: a residual stream's next value and its normalised
// form. Where the kernel applies (and DIFFRACT_FUSED_ADD_LAYER_NORM is not 0) one kernel writes
// both, from the sum rounded to x's dtype, so the results equal the separate add and layer_norm
// bit for bit; otherwise it is that add and layer_norm.
std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor& weight, const at::Tensor& bias, double eps);
// The DiTs' adaptive LayerNorm: x [B, T, D] normalised over D without parameters, then
// * (1 + scale) + shift, scale and shift [B, D] (or [1, D]) per batch item. ATen's three ops, or
// on CUDA where the kernel applies (and DIFFRACT_FUSED_MODULATION is not 0) one kernel that rounds
// as those ops do: only the normalisation's reduction order differs.
at::Tensor modulated_layer_norm(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double eps);
// modulated_layer_norm of one x under several (scale, shift) pairs (SD3.5's two attentions): where
// ATen's ops run, x is normalised once for all of them.
std::vector<at::Tensor> modulated_layer_norms(const at::Tensor& x,
                                              const std::vector<std::pair<at::Tensor, at::Tensor>>& modulations,
                                              double eps);
// x + gate * y for x, y [B, T, D] and gate [B, D] (or [1, D]): a DiT block's gated residual. On
// CUDA one kernel with the bits of ATen's two ops.
at::Tensor gated_residual(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y);
// {h, modulated_layer_norm(h, scale, shift, eps)} with h = gated_residual(x, gate, y): on CUDA
// one kernel writes both.
std::pair<at::Tensor, at::Tensor> gated_residual_modulated_layer_norm(const at::Tensor& x, const at::Tensor& gate,
                                                                      const at::Tensor& y, const at::Tensor& scale,
                                                                      const at::Tensor& shift, double eps);
// Whether modulated_layer_norm would run the kernel for these tensors (the GPU check asks).
bool modulation_uses_kernel(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift);
// Whether layer_norm would run the kernel for these tensors (the GPU check asks).
bool layer_norm_uses_kernel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
// Whether CUDA tensors take the kernel: built with it and not switched off (set_fused_layer_norm,
// or DIFFRACT_FUSED_LAYER_NORM=0 in the environment at start-up).
bool fused_layer_norm_available();
void set_fused_layer_norm(bool on);
// Forces the kernel's row layout (1, 2 or 4 warps per row) where the row fits it; 0 (the
// default) leaves the pick to the kernel. For the GPU check's timing of the layouts.
void set_layer_norm_warps_per_row(int warps);

}  // namespace diffract::models
