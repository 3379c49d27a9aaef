#include "core/models/common/fp8_kernels.h"

#include "core/models/common/activations.cuh"
#include "core/models/common/fp8_rows.cuh"
#include "core/models/common/kernel_types.cuh"

namespace diffract::models::kernels {

namespace {

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

// Where row r of x starts (elements).
__device__ __forceinline__ int64_t row_start(const QuantizeRowsArgs& a, int64_t r) {
  const int64_t b = r / a.rows_per_batch;
  return b * a.batch_stride + (r - b * a.rows_per_batch) * a.row_stride;
}

// act of element c of a row (rounded to T); `row` points at the row's first value.
template <typename T, RowActivation kAct>
__device__ __forceinline__ T activated(const T* row, int64_t c, int64_t cols) {
  if constexpr (kAct == RowActivation::GeluTanh) return from_float<T>(gelu_tanh(to_float(row[c])));
  else if constexpr (kAct == RowActivation::GegluHalves) return from_float<T>(gated(to_float(row[c]), to_float(row[cols + c])));
  else return row[c];
}

// 16-bit types, cols a multiple of 8, rows 16-byte aligned: 8 elements a load, held in
// registers (after the activation) between the amax and the quantisation; kChunks of them a
// thread at most, as few as the row needs (the registers held decide how many blocks an SM runs:
// with room for 8 chunks always, a row of 1536 ran at a third of the memory bandwidth).
// kPrefix: the row's first prefix_cols / 8 chunks come from a.prefix as they are.
template <typename T, RowActivation kAct, int kChunks, bool kPrefix = false>
__global__ void __launch_bounds__(kThreads) quantize_rows_held(QuantizeRowsArgs a) {
  struct alignas(16) V { T v[8]; };
  const int64_t row = blockIdx.x, lead = kPrefix ? a.prefix_cols / 8 : 0, chunks = lead + a.cols / 8;
  const int64_t width = kPrefix ? a.prefix_cols + a.cols : a.cols;  // of y's and q's rows
  const V* xr = reinterpret_cast<const V*>(static_cast<const T*>(a.x) + row_start(a, row)) - lead;
  const V* pr = kPrefix ? reinterpret_cast<const V*>(static_cast<const T*>(a.prefix) + row * a.prefix_stride) : nullptr;
  V held[kChunks];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    if (kPrefix && c < lead) {
      held[j] = pr[c];
      reinterpret_cast<V*>(static_cast<T*>(a.y) + row * width)[c] = held[j];
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(to_float(held[j].v[i])));
    } else if (c < chunks) {
      held[j] = xr[c];
      if constexpr (kAct != RowActivation::None) {
        V gate;
        if constexpr (kAct == RowActivation::GegluHalves) gate = xr[c + chunks];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if constexpr (kAct == RowActivation::GegluHalves)
            held[j].v[i] = from_float<T>(gated(to_float(held[j].v[i]), to_float(gate.v[i])));
          else
            held[j].v[i] = from_float<T>(gelu_tanh(to_float(held[j].v[i])));
        }
        reinterpret_cast<V*>(static_cast<T*>(a.y) + row * width)[c] = held[j];
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(to_float(held[j].v[i])));
    }
  }
  const float s = e4m3_row_scale(block_max(amax));
  const float inv = 1.f / s;
  if (threadIdx.x == 0) a.scale[row] = s;
  uint2* qr = reinterpret_cast<uint2*>(static_cast<uint8_t*>(a.q) + row * width);
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    if (c < chunks) qr[c] = e4m3x8(held[j].v, inv);
  }
}

// Any width and type: two passes over the row (the second from y where the activation wrote it,
// else from x: L1 / L2).
template <typename T, RowActivation kAct>
__global__ void __launch_bounds__(kThreads) quantize_rows_any(QuantizeRowsArgs a) {
  const int64_t row = blockIdx.x;
  const T* xr = static_cast<const T*>(a.x) + row_start(a, row);
  T* yr = kAct == RowActivation::None ? nullptr : static_cast<T*>(a.y) + row * a.cols;
  float amax = 0.f;
  for (int64_t c = threadIdx.x; c < a.cols; c += kThreads) {
    const T v = activated<T, kAct>(xr, c, a.cols);
    if constexpr (kAct != RowActivation::None) yr[c] = v;
    amax = fmaxf(amax, fabsf(to_float(v)));
  }
  const float s = e4m3_row_scale(block_max(amax));
  const float inv = 1.f / s;
  if (threadIdx.x == 0) a.scale[row] = s;
  uint8_t* qr = static_cast<uint8_t*>(a.q) + row * a.cols;
  const T* vr = kAct == RowActivation::None ? xr : yr;
  for (int64_t c = threadIdx.x; c < a.cols; c += kThreads) qr[c] = e4m3(to_float(vr[c]), inv);
}

template <typename T, RowActivation kAct, bool kPrefix>
void launch_held(const QuantizeRowsArgs& a, CUstream_st* stream) {
  const dim3 grid(static_cast<unsigned>(a.rows));
  const int64_t per_thread = ((a.prefix_cols + a.cols) / 8 + kThreads - 1) / kThreads;
  if (per_thread <= 1) quantize_rows_held<T, kAct, 1, kPrefix><<<grid, kThreads, 0, stream>>>(a);
  else if (per_thread <= 2) quantize_rows_held<T, kAct, 2, kPrefix><<<grid, kThreads, 0, stream>>>(a);
  else if (per_thread <= 4) quantize_rows_held<T, kAct, 4, kPrefix><<<grid, kThreads, 0, stream>>>(a);
  else quantize_rows_held<T, kAct, kMaxChunks, kPrefix><<<grid, kThreads, 0, stream>>>(a);
}

template <typename T, RowActivation kAct>
int launch(QuantizeRowsArgs a, CUstream_st* stream) {
  const auto at16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool prefix = a.prefix != nullptr;
  bool held = false;
  if constexpr (sizeof(T) == 2) {
    held = at16(a.x) && reinterpret_cast<uintptr_t>(a.q) % 8 == 0 && (kAct == RowActivation::None || at16(a.y)) &&
           a.cols % 8 == 0 && a.row_stride % 8 == 0 && a.batch_stride % 8 == 0 &&
           (!prefix || (at16(a.prefix) && a.prefix_cols % 8 == 0 && a.prefix_stride % 8 == 0)) &&
           (a.prefix_cols + a.cols) / 8 <= static_cast<int64_t>(kThreads) * kMaxChunks;
    if (held && prefix) {
      if constexpr (kAct == RowActivation::GeluTanh) launch_held<T, kAct, true>(a, stream);
      else return static_cast<int>(cudaErrorInvalidValue);
    } else if (held) {
      launch_held<T, kAct, false>(a, stream);
    }
  }
  if (!held && prefix) return static_cast<int>(cudaErrorInvalidValue);  // joined rows: the held kernel's only
  if (!held) quantize_rows_any<T, kAct><<<dim3(static_cast<unsigned>(a.rows)), kThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int quantize_rows_fp8(const QuantizeRowsArgs& a, CUstream_st* stream) {
  const int64_t width = a.act == RowActivation::GegluHalves ? 2 * a.cols : a.cols;
  QuantizeRowsArgs b = a;
  if (b.row_stride == 0) b.row_stride = width;
  if (b.rows_per_batch == 0) b.rows_per_batch = a.rows > 0 ? a.rows : 1, b.batch_stride = b.rows_per_batch * b.row_stride;
  if (!a.x || !a.q || !a.scale || a.rows < 0 || a.cols < 1 || a.rows > 0x7fffffff || b.row_stride < width ||
      b.rows_per_batch < 1 || b.batch_stride < 0 || (a.act != RowActivation::None) != (a.y != nullptr) ||
      (a.prefix && (a.act != RowActivation::GeluTanh || a.prefix_cols < 1 || a.prefix_stride < a.prefix_cols)) ||
      (!a.prefix && a.prefix_cols != 0))
    return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  return with_element_type(a.dtype, [&](auto v) {
    using T = decltype(v);
    switch (a.act) {
      case RowActivation::None: return launch<T, RowActivation::None>(b, stream);
      case RowActivation::GeluTanh: return launch<T, RowActivation::GeluTanh>(b, stream);
      case RowActivation::GegluHalves: return launch<T, RowActivation::GegluHalves>(b, stream);
    }
    return static_cast<int>(cudaErrorInvalidValue);
  });
}

}  // namespace diffract::models::kernels
