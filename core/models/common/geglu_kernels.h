#pragma once
// GEGLU's gate, a * gelu(b) with the exact (erf) GELU, as one CUDA kernel: ATen runs it as two
// (gelu, then the product), writing and reading gelu(b) in between; at SDXL's feed-forward
// widths that round trip costs measurably (docs/benchmarks.md). And the tanh GELU over strided
// rows (Flux's single blocks). Plain C++ over raw pointers (no torch headers), like the GroupNorm
// kernels.
#include <cstdint>

#include "core/models/common/group_norm_kernels.h"  // kernels::DType

struct CUstream_st;

namespace diffract::models::kernels {

// out[i] = a[i] * 0.5 * b[i] * (1 + erf(b[i] / sqrt(2))), computed in fp32, for n elements of
// `dtype` (a, b, out contiguous). Returns the CUDA error code of the launch (0: ok).
int geglu_forward(const void* a, const void* b, void* out, int64_t n, DType dtype, CUstream_st* stream);

// The same gate over the two halves of each row of one projection's output: y [rows, 2 inner]
// (contiguous) holds a in its first `inner` columns and b in the rest; out [rows, inner].
int geglu_halves_forward(const void* y, void* out, int64_t rows, int64_t inner, DType dtype, CUstream_st* stream);

// out = gelu(x) with the tanh approximation, in fp32 as ATen's kernel computes it, over `rows`
// rows of `cols` elements: x's rows `x_stride` elements apart, out's `out_stride` apart, each row
// contiguous (column slices of wider tensors, which ATen's element-wise kernels read one element
// at a time).
int gelu_tanh_rows_forward(const void* x, int64_t x_stride, void* out, int64_t out_stride, int64_t rows, int64_t cols,
                           DType dtype, CUstream_st* stream);

}  // namespace diffract::models::kernels
