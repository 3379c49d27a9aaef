#include "core/models/common/fp8_kernels.h"

#include <cuda_fp8.h>

#include "core/models/common/kernel_types.cuh"

namespace diffract::models::kernels {

namespace {

constexpr float kE4M3Max = 448.f;
constexpr float kMinScale = 1e-12f;
constexpr int kThreads = 256;
constexpr int kMaxChunks = 8;  // chunks of 8 elements a thread keeps: rows up to 16384 wide

__device__ float block_max(float v) {
  __shared__ float warp_max[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_max[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) warp_max[0] = v;
  }
  __syncthreads();
  return warp_max[0];
}

__device__ __forceinline__ __nv_fp8x2_storage_t to_e4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// 16-bit types, cols a multiple of 8, rows 16-byte aligned: 8 elements a load, held in
// registers between the amax and the quantisation.
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_rows_held(const T* __restrict__ x, uint8_t* __restrict__ q,
                                                               float* __restrict__ scale, int64_t cols) {
  const int64_t row = blockIdx.x, chunks = cols / 8;
  const uint4* xr = reinterpret_cast<const uint4*>(x + row * cols);
  uint4 held[kMaxChunks];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxChunks; ++j) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    if (c < chunks) {
      held[j] = xr[c];
      const T* e = reinterpret_cast<const T*>(&held[j]);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(to_float(e[i])));
    }
  }
  amax = block_max(amax);
  const float s = fmaxf(amax * (1.f / kE4M3Max), kMinScale);
  const float inv = 1.f / s;
  if (threadIdx.x == 0) scale[row] = s;
  uint2* qr = reinterpret_cast<uint2*>(q + row * cols);
#pragma unroll
  for (int j = 0; j < kMaxChunks; ++j) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    if (c < chunks) {
      const T* e = reinterpret_cast<const T*>(&held[j]);
      uint2 out;
      auto* o = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = to_e4m3x2(to_float(e[2 * i]) * inv, to_float(e[2 * i + 1]) * inv);
      qr[c] = out;
    }
  }
}

// Any width and type: two passes over the row (the second from L1 / L2).
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_rows_any(const T* __restrict__ x, uint8_t* __restrict__ q,
                                                              float* __restrict__ scale, int64_t cols) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  float amax = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) amax = fmaxf(amax, fabsf(to_float(xr[c])));
  amax = block_max(amax);
  const float s = fmaxf(amax * (1.f / kE4M3Max), kMinScale);
  const float inv = 1.f / s;
  if (threadIdx.x == 0) scale[row] = s;
  uint8_t* qr = q + row * cols;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads)
    qr[c] = __nv_cvt_float_to_fp8(to_float(xr[c]) * inv, __NV_SATFINITE, __NV_E4M3);
}

}  // namespace

int quantize_rows_fp8(const QuantizeRowsArgs& a, CUstream_st* stream) {
  if (!a.x || !a.q || !a.scale || a.rows < 0 || a.cols < 1 || a.rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  const bool aligned = reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && reinterpret_cast<uintptr_t>(a.q) % 8 == 0;
  return with_element_type(a.dtype, [&](auto v) {
    using T = decltype(v);
    const auto* x = static_cast<const T*>(a.x);
    auto* q = static_cast<uint8_t*>(a.q);
    const dim3 grid(static_cast<unsigned>(a.rows));
    bool held = false;
    if constexpr (sizeof(T) == 2) {
      held = aligned && a.cols % 8 == 0 && a.cols / 8 <= static_cast<int64_t>(kThreads) * kMaxChunks;
      if (held) quantize_rows_held<T><<<grid, kThreads, 0, stream>>>(x, q, a.scale, a.cols);
    }
    if (!held) quantize_rows_any<T><<<grid, kThreads, 0, stream>>>(x, q, a.scale, a.cols);
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace diffract::models::kernels
