#pragma once
// GEGLU's gate for the feed-forward blocks (attention.cpp), and the tanh GELU into a strided
// view: CUDA kernels where the build has them, ATen's ops elsewhere.
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
// out = gelu(x, "tanh") for x and out of one shape, written into out (a view, e.g. a column
// slice of a buffer another op fills too). Where both fold into evenly strided rows
// (strided_rows.h), one vectorised kernel with ATen's arithmetic (ATen's element-wise kernel takes
// such slices an element at a time: Flux's single blocks' GELU 6.96 -> 3.40 ms a step on an H100);
// at::gelu_out elsewhere and with DIFFRACT_GELU_SLICE_KERNEL=0.
void gelu_tanh_out(at::Tensor& out, const at::Tensor& x);
// Whether gelu_tanh_out runs the kernel for these tensors.
bool gelu_tanh_uses_kernel(const at::Tensor& out, const at::Tensor& x);
// Whether CUDA tensors take the fused kernel (built with it, and not switched off).
bool fused_geglu_available();
void set_fused_geglu(bool on);

}  // namespace diffract::models
