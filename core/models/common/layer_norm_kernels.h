#pragma once
// LayerNorm over the last dimension as one CUDA kernel for fp16 / bf16 rows: affine (the UNets'
// transformer blocks) or modulated per batch item (the DiTs' adaptive LayerNorm), optionally
// after a residual add, gated or not; and the DiTs' gated residual on its own. Plain C++ over raw
// pointers, so the .cu needs no torch headers; layer_norm.cpp is the only caller.
//
// Why: ATen's vectorized_layer_norm_kernel takes about three times as long as its DRAM traffic on
// the SDXL transformer blocks' [2, 4096, 640] and [2, 1024, 1280] rows (docs/benchmarks.md).
// Here one warp (or, for long rows, a few) holds a row in registers: one read of x, one
// write of y, and the variance taken as a second pass over the registers (fp32, no E[x^2] - m^2
// cancellation).
#include <cstdint>

#include "core/models/common/group_norm_kernels.h"  // kernels::DType

struct CUstream_st;

namespace diffract::models::kernels {

struct LayerNormArgs {
  const void* x = nullptr;       // [rows, c], dtype, contiguous
  const void* weight = nullptr;  // [c], dtype
  const void* bias = nullptr;    // [c], dtype
  void* y = nullptr;             // [rows, c], dtype
  // Both set or neither: the kernel normalises x + residual (rounded to dtype, as an add in
  // dtype would be) and writes that sum to `sum` as well.
  const void* residual = nullptr;  // [rows, c], dtype
  void* sum = nullptr;             // [rows, c], dtype
  // Modulation (DiTs): with rows_per_batch > 0, weight and bias are a scale and a shift per batch
  // item b = row / rows_per_batch, read at weight + b * scale_stride and bias + b * shift_stride
  // (elements), and y = norm(x) * (1 + scale) + shift with each op rounded to dtype, as ATen's
  // separate ops round them.
  int64_t rows_per_batch = 0;
  int64_t scale_stride = 0, shift_stride = 0;
  // With residual (gated residual): sum = x + gate * residual, the product rounded to dtype
  // first, gate read at gate + b * gate_stride as the scale is.
  const void* gate = nullptr;
  int64_t gate_stride = 0;
  int64_t rows = 0, c = 0;
  float eps = 1e-5f;
  DType dtype = DType::BFloat16;
  int sm_count = 0;  // the GPU's; picks when the kernel loads weight and bias (0: after the reductions)
  int warps_per_row = 0;  // 1, 2 or 4 to force a row layout where it fits (timing runs); 0: the kernel's pick
  // Both set or neither: y's rows in e4m3 as well (the input of an fp8 GEMM, fp8_linear.h), each
  // with its scale, from y as written (rounded to dtype): equal to quantize_rows_fp8 of y. BFloat16 only.
  void* q = nullptr;         // [rows, c] e4m3, 8-byte aligned
  float* q_scale = nullptr;  // [rows]
};

// Whether the kernel takes rows of `c` values of `dtype`: Half or BFloat16, C a multiple of 8
// and at most kLayerNormMaxC. Every pointer must also be 16-byte aligned. The caller falls back
// to ATen.
constexpr int64_t kLayerNormMaxC = 8192;
bool layer_norm_supported(DType dtype, int64_t c);
// Launches the kernel on `stream`; returns the CUDA error code of the launch (0: ok), or
// cudaErrorInvalidValue for a case the kernel does not take.
int layer_norm_forward(const LayerNormArgs& a, CUstream_st* stream);

// out = x + gate * y, gate [batches, c] per batch item b = row / rows_per_batch (at gate + b *
// gate_stride), the product rounded to dtype before the add, as ATen's two ops round.
struct GatedResidualArgs {
  const void* x = nullptr;  // [rows, c], dtype, contiguous
  const void* y = nullptr;  // [rows, c], dtype, contiguous
  const void* gate = nullptr;
  void* out = nullptr;      // [rows, c], dtype; may be x
  int64_t rows = 0, c = 0, rows_per_batch = 0, gate_stride = 0;
  DType dtype = DType::BFloat16;
};
// Half or BFloat16, c a multiple of 8, gate_stride too, every pointer 16-byte aligned; otherwise
// cudaErrorInvalidValue without a launch.
int gated_residual_forward(const GatedResidualArgs& a, CUstream_st* stream);

}  // namespace diffract::models::kernels
