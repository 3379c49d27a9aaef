#pragma once
// LayerNorm over the last dimension (affine) as one CUDA kernel for fp16 / bf16 rows. Plain C++
// over raw pointers, so the .cu needs no torch headers; models::layer_norm (layer_norm.h) is the
// only caller.
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
  int64_t rows = 0, c = 0;
  float eps = 1e-5f;
  DType dtype = DType::BFloat16;
  int sm_count = 0;  // the GPU's; picks when the kernel loads weight and bias (0: after the reductions)
  int warps_per_row = 0;  // 1, 2 or 4 to force a row layout where it fits (timing runs); 0: the kernel's pick
};

// Whether the kernel takes rows of `c` values of `dtype`: Half or BFloat16, C a multiple of 8
// and at most kLayerNormMaxC. Every pointer must also be 16-byte aligned. The caller falls back
// to ATen.
constexpr int64_t kLayerNormMaxC = 8192;
bool layer_norm_supported(DType dtype, int64_t c);
// Launches the kernel on `stream`; returns the CUDA error code of the launch (0: ok), or
// cudaErrorInvalidValue for a case the kernel does not take.
int layer_norm_forward(const LayerNormArgs& a, CUstream_st* stream);

}  // namespace diffract::models::kernels
