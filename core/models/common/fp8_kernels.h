#pragma once
// Per-token (row-wise) quantisation of activations to fp8 e4m3, the input side of the fp8 GEMMs
// (fp8_linear.h): one kernel, one block a row, the row's amax and its quantisation in one pass
// over the activations (a row of up to 16384 halves stays in registers). Plain C++ over raw
// pointers (no torch headers), like the other kernels.
#include <cstdint>

#include "core/models/common/group_norm_kernels.h"  // kernels::DType

struct CUstream_st;

namespace diffract::models::kernels {

struct QuantizeRowsArgs {
  const void* x = nullptr;  // [rows, cols] contiguous, dtype
  void* q = nullptr;        // [rows, cols] e4m3 (one byte an element), contiguous
  float* scale = nullptr;   // [rows]
  int64_t rows = 0, cols = 0;
  DType dtype = DType::BFloat16;
};

// scale[r] = max(max_c |x[r, c]| * (1 / 448), 1e-12) and q[r, c] = e4m3(x[r, c] * (1 / scale[r])),
// rounded to nearest even and saturated to +-448, computed in fp32: x[r, c] ~ q[r, c] * scale[r].
// Returns the CUDA error code of the launch (0: ok).
int quantize_rows_fp8(const QuantizeRowsArgs& a, CUstream_st* stream);

}  // namespace diffract::models::kernels
