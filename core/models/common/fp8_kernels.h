#pragma once
// Per-token (row-wise) quantisation of activations to fp8 e4m3, the input side of the fp8 GEMMs
// (fp8_linear.h): one kernel, one block a row, the row's amax and its quantisation in one pass
// over the activations (a row of up to 16384 halves stays in registers). The rows may lie apart
// (a slice of tokens from each batch item of a joint sequence: no copy first), and the kernel may
// apply the activation that makes them (an fp8 MLP's GELU or GEGLU gate), writing its output as
// well, so the next GEMM's input costs no pass of its own. Plain C++ over raw pointers (no torch
// headers), like the other kernels.
#include <cstdint>

#include "core/models/common/group_norm_kernels.h"  // kernels::DType

struct CUstream_st;

namespace diffract::models::kernels {

// What the kernel applies to x's rows before quantising them (each rounded to dtype, as ATen's
// op would write it; quantised from that rounded value).
enum class RowActivation {
  None,
  GeluTanh,     // gelu(x, "tanh")
  GegluHalves,  // x's row holds a then b, 2 cols wide: a * gelu(b) (exact GELU)
};

struct QuantizeRowsArgs {
  // Row r (of `rows`) of batch item b = r / rows_per_batch starts at x + b * batch_stride +
  // (r % rows_per_batch) * row_stride elements; its `cols` values (2 cols for GegluHalves) are
  // contiguous. row_stride 0: the row's own width; rows_per_batch 0: every row in one batch item.
  const void* x = nullptr;
  int64_t row_stride = 0, rows_per_batch = 0, batch_stride = 0;
  void* q = nullptr;        // [rows, cols] e4m3 (one byte an element), contiguous
  float* scale = nullptr;   // [rows]
  void* y = nullptr;        // [rows, cols] of dtype, contiguous: the activation's output (required with one)
  int64_t rows = 0, cols = 0;
  RowActivation act = RowActivation::None;
  DType dtype = DType::BFloat16;
  // With GeluTanh, rows joined from two sources (Flux's single blocks: the attention's output,
  // then the MLP's GELU): the first prefix_cols values of row r taken as they are from prefix +
  // r * prefix_stride elements, then act's cols; y's and q's rows are then prefix_cols + cols
  // wide. 16-bit types with every row 16-byte aligned and both widths multiples of 8 only.
  const void* prefix = nullptr;
  int64_t prefix_cols = 0, prefix_stride = 0;
};

// v = act(x) rounded to dtype (x itself with None); y[r, c] = v where y is given;
// scale[r] = max(max_c |v[r, c]| * (1 / 448), 1e-12) and q[r, c] = e4m3(v[r, c] * (1 / scale[r])),
// rounded to nearest even and saturated to +-448, computed in fp32: v[r, c] ~ q[r, c] * scale[r].
// With a prefix, v = [prefix's row, act(x's row)]. Returns the CUDA error code of the launch (0:
// ok; cudaErrorInvalidValue without a launch for arguments it does not take).
int quantize_rows_fp8(const QuantizeRowsArgs& a, CUstream_st* stream);

}  // namespace diffract::models::kernels
