#include "core/models/common/bias_add_kernels.h"

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/models/common/kernel_types.cuh"

namespace diffract::models::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
struct alignas(16) Vec {
  T v[16 / sizeof(T)];
};

// Vector i covers elements [i * per, (i + 1) * per). Channels-last (plane 1, c % per == 0): the
// vector's channels are consecutive, one bias vector. NCHW (plane % per == 0): one channel.
template <typename T, bool kChannelsLast, bool kResidual>
__global__ void bias_add_vec(BiasAddArgs a) {
  using V = Vec<T>;
  constexpr int per = 16 / sizeof(T);
  const int64_t vectors = a.numel / per;
  V* y = static_cast<V*>(a.y);
  const T* bias = static_cast<const T*>(a.bias);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vectors;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    V v = y[i];
    V r;
    if constexpr (kResidual) r = static_cast<const V*>(a.residual)[i];
    if constexpr (kChannelsLast) {
      const int64_t bv = (i * per % a.c) / per;
      const V b = reinterpret_cast<const V*>(bias)[bv];
      V rb;
      if (kResidual && a.residual_bias) rb = reinterpret_cast<const V*>(a.residual_bias)[bv];
#pragma unroll
      for (int k = 0; k < per; ++k) {
        float s = to_float(v.v[k]) + to_float(b.v[k]);
        if constexpr (kResidual) s += to_float(r.v[k]) + (a.residual_bias ? to_float(rb.v[k]) : 0.f);
        v.v[k] = from_float<T>(s);
      }
    } else {
      const int64_t c = (i * per / a.plane) % a.c;
      float b = to_float(bias[c]);
      if (kResidual && a.residual_bias) b += to_float(static_cast<const T*>(a.residual_bias)[c]);
#pragma unroll
      for (int k = 0; k < per; ++k) {
        float s = to_float(v.v[k]) + b;
        if constexpr (kResidual) s += to_float(r.v[k]);
        v.v[k] = from_float<T>(s);
      }
    }
    y[i] = v;
  }
}

template <typename T, bool kChannelsLast, bool kResidual>
int launch(const BiasAddArgs& a, cudaStream_t stream) {
  constexpr int per = 16 / sizeof(T);
  const int64_t vectors = a.numel / per;
  const int blocks = static_cast<int>(std::min<int64_t>((vectors + kThreads - 1) / kThreads, 65535 * 8));
  bias_add_vec<T, kChannelsLast, kResidual><<<std::max(blocks, 1), kThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int dispatch(const BiasAddArgs& a, cudaStream_t stream) {
  constexpr int per = 16 / sizeof(T);
  const bool channels_last = a.plane == 1;
  if (channels_last ? a.c % per != 0 : a.plane % per != 0) return static_cast<int>(cudaErrorInvalidValue);
  if (channels_last) return a.residual ? launch<T, true, true>(a, stream) : launch<T, true, false>(a, stream);
  return a.residual ? launch<T, false, true>(a, stream) : launch<T, false, false>(a, stream);
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

int bias_add(const BiasAddArgs& a, CUstream_st* stream) {
  if (!a.y || !a.bias || a.c < 1 || a.plane < 1 || a.numel < 1 || a.numel % (a.c * a.plane) != 0 || !aligned(a.y) ||
      !aligned(a.bias) || (a.residual && !aligned(a.residual)) ||
      (a.residual_bias && (!a.residual || !aligned(a.residual_bias))))
    return static_cast<int>(cudaErrorInvalidValue);
  return with_element_type(a.dtype, [&](auto v) { return dispatch<decltype(v)>(a, stream); });
}

}  // namespace diffract::models::kernels
