#pragma once
#include <string>

#include <ATen/core/Tensor.h>

namespace diffract::models {

// Scaled dot-product attention over packed heads.
// q: [B, Tq, H*D], k, v: [B, Tk, H*D] -> [B, Tq, H*D]. Uses the fused (flash / memory-
// efficient) kernels where the device has them.
at::Tensor multi_head_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads,
                                bool causal = false);

enum class Activation { QuickGELU, GELU, GELUTanh, SiLU };

// Names as transformers / diffusers configs spell them ("quick_gelu", "gelu", "gelu_new",
// "gelu_pytorch_tanh", "silu"); anything else is an error naming `where`.
Activation parse_activation(const std::string& name, const std::string& where);
at::Tensor apply_activation(Activation act, const at::Tensor& x);

}  // namespace diffract::models
