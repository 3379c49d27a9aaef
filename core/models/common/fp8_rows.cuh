#pragma once
// Per-row e4m3 quantisation as every kernel that writes fp8 rows computes it (fp8_kernels.cu on
// its own, layer_norm_kernels.cu beside its output): scale = max(amax * (1 / 448), 1e-12) and
// q = e4m3(v * (1 / scale)), rounded to nearest even and saturated, in fp32. The same arithmetic
// everywhere is what makes a kernel's fused rows equal quantize_rows_fp8 of its output.
#include <cstdint>

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "core/models/common/kernel_types.cuh"

namespace diffract::models::kernels {

constexpr float kE4M3Max = 448.f;
constexpr float kMinScale = 1e-12f;

__device__ __forceinline__ float e4m3_row_scale(float amax) { return fmaxf(amax * (1.f / kE4M3Max), kMinScale); }

// Eight values of T at `in`, times `inv` (1 / the row's scale), as eight e4m3 bytes in one uint2.
template <typename T>
__device__ __forceinline__ uint2 e4m3x8(const T* in, float inv) {
  uint2 out;
  auto* o = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    o[i] = __nv_cvt_float2_to_fp8x2(make_float2(to_float(in[2 * i]) * inv, to_float(in[2 * i + 1]) * inv),
                                    __NV_SATFINITE, __NV_E4M3);
  return out;
}

__device__ __forceinline__ uint8_t e4m3(float v, float inv) {
  return __nv_cvt_float_to_fp8(v * inv, __NV_SATFINITE, __NV_E4M3);
}

}  // namespace diffract::models::kernels
