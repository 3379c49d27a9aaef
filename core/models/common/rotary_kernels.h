#pragma once
// The queries' and keys' RMSNorm and rotary embedding as one CUDA kernel: ATen runs them as a
// dozen passes in float32 over every head (statistics, scale, weight, the rotated copy, the two
// products, the sum, the casts). Plain C++ over raw pointers (no torch headers).
#include <cstdint>

#include "core/models/common/group_norm_kernels.h"  // kernels::DType

struct CUstream_st;

namespace diffract::models::kernels {

struct RmsNormRopeArgs {
  const void* x = nullptr;       // [B, T, H, D] of `dtype`, the last dimension contiguous
  int64_t x_stride_b = 0, x_stride_t = 0, x_stride_h = 0;
  const void* weight = nullptr;  // [D] of `dtype`
  const float* cos = nullptr;    // [T, D] contiguous: the rope rows of these tokens
  const float* sin = nullptr;
  void* out = nullptr;           // [B, T, H, D] of `dtype` with the given batch and token strides
  int64_t out_stride_b = 0, out_stride_t = 0;
  int64_t batch = 0, tokens = 0, heads = 0, dim = 0;  // dim even, at most 512
  float eps = 1e-6f;
  DType dtype = DType::BFloat16;
  bool vectorise = false;        // four elements a lane where the pointers and strides allow
};

// Per row of D: y = x * rsqrt(mean(x²) + eps) in fp32, rounded to the element type, times the
// weight, rounded again (diffusers' RMSNorm in half precision), then each pair (y[2i], y[2i+1])
// rotated: (y0 cos - y1 sin, y1 cos + y0 sin) with separately rounded products and sum (as ATen's
// x * cos + rotated * sin), rounded to the element type. Returns the CUDA error code of the
// launch (0: ok).
bool rms_norm_rope_supported(int64_t dim);
int rms_norm_rope_forward(const RmsNormRopeArgs& a, CUstream_st* stream);

}  // namespace diffract::models::kernels
