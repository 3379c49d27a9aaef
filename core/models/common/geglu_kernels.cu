#include "core/models/common/geglu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/models/common/activations.cuh"
#include "core/models/common/kernel_types.cuh"

namespace diffract::models::kernels {
namespace {

constexpr int kThreads = 256;

// 16-byte vectors where every pointer is aligned; the tail (and unaligned tensors) one element at
// a time.
template <typename T>
__global__ void geglu(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t n, bool vec) {
  constexpr int per = 16 / sizeof(T);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t first = 0;
  if (vec) {
    struct alignas(16) V { T v[per]; };
    const int64_t vectors = n / per;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vectors; i += stride) {
      const V va = reinterpret_cast<const V*>(a)[i], vb = reinterpret_cast<const V*>(b)[i];
      V vo;
#pragma unroll
      for (int k = 0; k < per; ++k) vo.v[k] = from_float<T>(gated(to_float(va.v[k]), to_float(vb.v[k])));
      reinterpret_cast<V*>(out)[i] = vo;
    }
    first = vectors * per;
  }
  for (int64_t i = first + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
    out[i] = from_float<T>(gated(to_float(a[i]), to_float(b[i])));
}

// Row r of y holds a in columns [0, inner) and b in [inner, 2 inner): element i of the output
// (row i / inner, column i % inner) reads both with the row's offset; 16-byte vectors when inner
// and the pointers allow, else one element at a time.
template <typename T>
__global__ void geglu_halves(const T* __restrict__ y, T* __restrict__ out, int64_t rows, int64_t inner, bool vec) {
  constexpr int per = 16 / sizeof(T);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (vec) {
    struct alignas(16) V { T v[per]; };
    const int64_t row_vectors = inner / per, vectors = rows * row_vectors;
    const V* yv = reinterpret_cast<const V*>(y);
    for (int64_t i = first; i < vectors; i += stride) {
      const int64_t r = i / row_vectors, c = i - r * row_vectors;
      const V va = yv[2 * r * row_vectors + c], vb = yv[(2 * r + 1) * row_vectors + c];
      V vo;
#pragma unroll
      for (int k = 0; k < per; ++k) vo.v[k] = from_float<T>(gated(to_float(va.v[k]), to_float(vb.v[k])));
      reinterpret_cast<V*>(out)[i] = vo;
    }
    return;
  }
  for (int64_t i = first; i < rows * inner; i += stride) {
    const int64_t r = i / inner, c = i - r * inner;
    out[i] = from_float<T>(gated(to_float(y[2 * r * inner + c]), to_float(y[(2 * r + 1) * inner + c])));
  }
}

// Element i of the output is row i / cols, column i % cols; 16-byte vectors when the columns, the
// strides and the pointers allow, else one element at a time.
template <typename T>
__global__ void gelu_tanh_rows(const T* __restrict__ x, int64_t x_stride, T* __restrict__ out, int64_t out_stride,
                               int64_t rows, int64_t cols, bool vec) {
  constexpr int per = 16 / sizeof(T);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (vec) {
    struct alignas(16) V { T v[per]; };
    const int64_t row_vectors = cols / per, vectors = rows * row_vectors;
    for (int64_t i = first; i < vectors; i += stride) {
      const int64_t r = i / row_vectors, c = (i - r * row_vectors) * per;
      const V vx = *reinterpret_cast<const V*>(x + r * x_stride + c);
      V vo;
#pragma unroll
      for (int k = 0; k < per; ++k) vo.v[k] = from_float<T>(gelu_tanh(to_float(vx.v[k])));
      *reinterpret_cast<V*>(out + r * out_stride + c) = vo;
    }
    return;
  }
  for (int64_t i = first; i < rows * cols; i += stride) {
    const int64_t r = i / cols, c = i - r * cols;
    out[r * out_stride + c] = from_float<T>(gelu_tanh(to_float(x[r * x_stride + c])));
  }
}

template <typename T>
int launch_gelu_tanh_rows(const void* x, int64_t x_stride, void* out, int64_t out_stride, int64_t rows, int64_t cols,
                          cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return 0;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const int64_t per = 16 / sizeof(T);
  const bool vec = aligned(x) && aligned(out) && cols % per == 0 && x_stride % per == 0 && out_stride % per == 0;
  const int64_t work = vec ? rows * cols / per : rows * cols;
  const int blocks = static_cast<int>(std::min<int64_t>((work + kThreads - 1) / kThreads, 65535));
  gelu_tanh_rows<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(x), x_stride, static_cast<T*>(out),
                                                      out_stride, rows, cols, vec);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_halves(const void* y, void* out, int64_t rows, int64_t inner, cudaStream_t stream) {
  if (rows <= 0 || inner <= 0) return 0;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const int64_t per = 16 / sizeof(T);
  const bool vec = aligned(y) && aligned(out) && inner % per == 0;
  const int64_t work = vec ? rows * inner / per : rows * inner;
  const int blocks = static_cast<int>(std::min<int64_t>((work + kThreads - 1) / kThreads, 65535));
  geglu_halves<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(y), static_cast<T*>(out), rows, inner, vec);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch(const void* a, const void* b, void* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return 0;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = aligned(a) && aligned(b) && aligned(out);
  const int64_t per = 16 / sizeof(T);
  const int64_t work = vec ? (n + per - 1) / per : n;
  const int blocks = static_cast<int>(std::min<int64_t>((work + kThreads - 1) / kThreads, 65535));
  geglu<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n,
                                             vec);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int gelu_tanh_rows_forward(const void* x, int64_t x_stride, void* out, int64_t out_stride, int64_t rows, int64_t cols,
                           DType dtype, CUstream_st* stream) {
  return with_element_type(
      dtype, [&](auto v) { return launch_gelu_tanh_rows<decltype(v)>(x, x_stride, out, out_stride, rows, cols, stream); });
}

int geglu_forward(const void* a, const void* b, void* out, int64_t n, DType dtype, CUstream_st* stream) {
  return with_element_type(dtype, [&](auto v) { return launch<decltype(v)>(a, b, out, n, stream); });
}

int geglu_halves_forward(const void* y, void* out, int64_t rows, int64_t inner, DType dtype, CUstream_st* stream) {
  return with_element_type(dtype, [&](auto v) { return launch_halves<decltype(v)>(y, out, rows, inner, stream); });
}

}  // namespace diffract::models::kernels
