#pragma once
// GEGLU's gate for the feed-forward blocks (attention.cpp): one CUDA kernel where the build has
// the kernels, ATen's two elsewhere.
#include <ATen/core/Tensor.h>

namespace diffract::models {

// a * gelu(b) (exact GELU), a and b of one shape and dtype.
at::Tensor geglu(const at::Tensor& a, const at::Tensor& b);
// The same gate over the halves of y's last dimension: y [..., 2 inner] holds a then b ->
// [..., inner]. One kernel reading both halves in place where geglu's kernel applies (y
// contiguous), else chunk and ATen's ops.
at::Tensor geglu_halves(const at::Tensor& y);
// Whether geglu_halves runs the kernel for y.
bool geglu_halves_uses_kernel(const at::Tensor& y);
// Whether CUDA tensors take the fused kernel (built with it, and not switched off).
bool fused_geglu_available();
void set_fused_geglu(bool on);

}  // namespace diffract::models
