#pragma once
// GEGLU's gate for the feed-forward blocks (attention.cpp): one CUDA kernel where the build has
// the kernels, ATen's two elsewhere.
#include <ATen/core/Tensor.h>

namespace diffract::models {

// a * gelu(b) (exact GELU), a and b of one shape and dtype.
at::Tensor geglu(const at::Tensor& a, const at::Tensor& b);
// Whether CUDA tensors take the fused kernel (built with it, and not switched off).
bool fused_geglu_available();
void set_fused_geglu(bool on);

}  // namespace diffract::models
