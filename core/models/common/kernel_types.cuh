#pragma once
// What the .cu kernels share: the element type for a DType, loads to fp32 and stores back, for
// float, half and bfloat16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/models/common/group_norm_kernels.h"  // DType

namespace diffract::models::kernels {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

// f(T{}) with T the element type of `t`: a host entry point's one switch over the types, e.g.
// with_element_type(a.dtype, [&](auto v) { return launch<decltype(v)>(a, stream); }).
template <typename F>
int with_element_type(DType t, F&& f) {
  switch (t) {
    case DType::Float: return f(float{});
    case DType::Half: return f(__half{});
    case DType::BFloat16: return f(__nv_bfloat16{});
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace diffract::models::kernels
