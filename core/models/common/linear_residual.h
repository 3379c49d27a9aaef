#pragma once
// A Linear layer's output with a residual added: the transformer blocks' `h + to_out(...)` and
// `h + ff(...)`. On CUDA (fp16 / bf16) one cuBLASLt GEMM adds the residual as its C operand and
// the bias in its epilogue; ATen ran the add as a separate kernel, about 2 ms of SDXL's 32 ms
// step on an H200 (~210 adds reading and writing [2, 4096, 640] tensors).
#include <ATen/core/Tensor.h>

namespace diffract::models {

// residual + x @ weight^T + bias: x [..., K], weight [N, K], bias [N] or undefined, residual
// [..., N] (x's leading dims). Returns a new tensor; residual is left as it is.
at::Tensor linear_residual(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& residual);
// The fused GEMM alone: false where it does not apply (not a contiguous fp16 / bf16 CUDA case,
// autograd recording, switched off, no cuBLASLt kernel for it), out then untouched.
// linear_residual falls back to ATen's ops there; the GPU check asks it directly.
bool try_fused_linear_residual(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& residual, at::Tensor& out);
// Whether CUDA tensors take the fused GEMM (built with CUDA and cuBLASLt, and not switched
// off). On by default; DIFFRACT_FUSED_RESIDUAL=0 in the environment starts it off.
bool fused_linear_residual_available();
void set_fused_linear_residual(bool on);

}  // namespace diffract::models
