#pragma once
// A Linear layer's output with a residual added: the transformer blocks' `h + to_out(...)` and
// `h + ff(...)`. On CUDA (fp16 / bf16) one cuBLASLt GEMM can add the residual as its C operand
// and the bias in its epilogue instead of ATen's separate add (~210 adds in SDXL's step). Which
// of the two runs is decided per case (shape, dtype, bias, alignments) the first time it is seen
// outside a graph capture, by timing ATen's ops against cuBLASLt's candidate algorithms.
#include <ATen/core/Tensor.h>

namespace diffract::models {

// residual + x @ weight^T + bias: x [..., K], weight [N, K], bias [N] or undefined, residual
// [..., N] (x's leading dims). Returns a new tensor; residual is left as it is.
at::Tensor linear_residual(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& residual);
// The fused GEMM alone: false where it does not apply (not a contiguous fp16 / bf16 CUDA case,
// autograd recording, switched off, no cuBLASLt kernel for it, ATen's ops timed faster for the
// case, or an unseen case under graph capture), out then untouched.
bool try_fused_linear_residual(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& residual, at::Tensor& out);
// Whether CUDA tensors may take the fused GEMM (built with CUDA and cuBLASLt, and switched on).
// Off by default (see linear_residual.cpp); DIFFRACT_FUSED_RESIDUAL=1 in the environment starts it on.
bool fused_linear_residual_available();
void set_fused_linear_residual(bool on);

// cuBLASLt's GEMM with a chosen algorithm, for the GPU check that times them: x @ weight^T +
// bias (+ residual when defined), the same operands as above. lt_gemm_candidates: how many
// algorithms cuBLASLt's heuristic offers for the case, up to max (0 where it does not take it,
// and without cuBLASLt). lt_gemm: the GEMM with candidate `index` (0: the heuristic's first
// pick); false, out untouched, where there is no such candidate.
int lt_gemm_candidates(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       const at::Tensor& residual, int max);
bool lt_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& residual,
             int index, at::Tensor& out);

}  // namespace diffract::models
