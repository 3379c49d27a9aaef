#include "core/models/common/rotary_kernels.h"

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/models/common/kernel_types.cuh"

namespace diffract::models::kernels {
namespace {

constexpr int kWarps = 8;        // rows per block, one warp each
constexpr int kMaxPairs = 8;     // per lane: dim up to 2 * 32 * 8 = 512

template <typename T>
__device__ __forceinline__ float rounded(float v) { return to_float(from_float<T>(v)); }

// This warp's row (one head of one token): its input, its output and its token; x null past the
// last row.
template <typename T>
struct Row {
  const T* x = nullptr;
  T* out = nullptr;
  int64_t token = 0;
};

template <typename T>
__device__ __forceinline__ Row<T> row_of(const RmsNormRopeArgs& a) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= a.batch * a.tokens * a.heads) return {};
  const int64_t h = row % a.heads, t = (row / a.heads) % a.tokens, b = row / (a.heads * a.tokens);
  return {static_cast<const T*>(a.x) + b * a.x_stride_b + t * a.x_stride_t + h * a.x_stride_h,
          static_cast<T*>(a.out) + b * a.out_stride_b + t * a.out_stride_t + h * a.dim, t};
}

template <typename T>
__global__ void rms_norm_rope(RmsNormRopeArgs a) {
  const int lane = threadIdx.x & 31;
  const Row<T> row = row_of<T>(a);
  if (!row.x) return;
  const T* w = static_cast<const T*>(a.weight);
  const int64_t pairs = a.dim / 2;
  float v0[kMaxPairs], v1[kMaxPairs];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxPairs; ++i) {
    const int64_t p = lane + 32 * i;
    v0[i] = v1[i] = 0.f;
    if (p < pairs) {
      v0[i] = to_float(row.x[2 * p]);
      v1[i] = to_float(row.x[2 * p + 1]);
      ss += v0[i] * v0[i] + v1[i] * v1[i];
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float r = rsqrtf(ss / static_cast<float>(a.dim) + a.eps);
  const float* cs = a.cos + row.token * a.dim;
  const float* sn = a.sin + row.token * a.dim;
#pragma unroll
  for (int i = 0; i < kMaxPairs; ++i) {
    const int64_t p = lane + 32 * i;
    if (p >= pairs) continue;
    const float y0 = rounded<T>(__fmul_rn(rounded<T>(__fmul_rn(v0[i], r)), to_float(w[2 * p])));
    const float y1 = rounded<T>(__fmul_rn(rounded<T>(__fmul_rn(v1[i], r)), to_float(w[2 * p + 1])));
    row.out[2 * p] = from_float<T>(__fadd_rn(__fmul_rn(y0, cs[2 * p]), __fmul_rn(-y1, sn[2 * p])));
    row.out[2 * p + 1] = from_float<T>(__fadd_rn(__fmul_rn(y1, cs[2 * p + 1]), __fmul_rn(y0, sn[2 * p + 1])));
  }
}

// The same per row, with each lane on four consecutive elements (two pairs): 8-byte loads and
// stores of bf16 / fp16 (16 of fp32) and 16-byte loads of the rope rows, where the scalar form's
// 2-byte accesses kept it at a third of the memory bandwidth (Flux.1's [1, 4608, 24, 128]: 53 µs
// on an H100). Only the order of the sum of squares differs.
template <typename T>
__global__ void rms_norm_rope_vec(RmsNormRopeArgs a) {
  struct alignas(4 * sizeof(T)) V { T v[4]; };
  const int lane = threadIdx.x & 31;
  const Row<T> row = row_of<T>(a);
  if (!row.x) return;
  constexpr int kMaxQuads = kMaxPairs / 2;
  const int64_t quads = a.dim / 4;
  float v[kMaxQuads][4];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxQuads; ++i) {
    const int64_t q = lane + 32 * i;
    if (q < quads) {
      const V vx = reinterpret_cast<const V*>(row.x)[q];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[i][k] = to_float(vx.v[k]);
        ss += v[i][k] * v[i][k];
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float r = rsqrtf(ss / static_cast<float>(a.dim) + a.eps);
  const float4* cs = reinterpret_cast<const float4*>(a.cos + row.token * a.dim);
  const float4* sn = reinterpret_cast<const float4*>(a.sin + row.token * a.dim);
#pragma unroll
  for (int i = 0; i < kMaxQuads; ++i) {
    const int64_t q = lane + 32 * i;
    if (q >= quads) continue;
    const V vw = reinterpret_cast<const V*>(a.weight)[q];
    const float4 c = cs[q], sv = sn[q];
    const float cc[4] = {c.x, c.y, c.z, c.w}, ssn[4] = {sv.x, sv.y, sv.z, sv.w};
    float y[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) y[k] = rounded<T>(__fmul_rn(rounded<T>(__fmul_rn(v[i][k], r)), to_float(vw.v[k])));
    V vo;
#pragma unroll
    for (int k = 0; k < 4; k += 2) {
      vo.v[k] = from_float<T>(__fadd_rn(__fmul_rn(y[k], cc[k]), __fmul_rn(-y[k + 1], ssn[k])));
      vo.v[k + 1] = from_float<T>(__fadd_rn(__fmul_rn(y[k + 1], cc[k + 1]), __fmul_rn(y[k], ssn[k + 1])));
    }
    reinterpret_cast<V*>(row.out)[q] = vo;
  }
}

template <typename T>
bool vectorisable(const RmsNormRopeArgs& a) {
  const auto aligned = [](const void* p, std::size_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; };
  return a.dim % 4 == 0 && aligned(a.x, 4 * sizeof(T)) && aligned(a.out, 4 * sizeof(T)) &&
         aligned(a.weight, 4 * sizeof(T)) && aligned(a.cos, 16) && aligned(a.sin, 16) && a.x_stride_b % 4 == 0 &&
         a.x_stride_t % 4 == 0 && a.x_stride_h % 4 == 0 && a.out_stride_b % 4 == 0 && a.out_stride_t % 4 == 0;
}

}  // namespace

bool rms_norm_rope_supported(int64_t dim) { return dim > 0 && dim % 2 == 0 && dim <= 2 * 32 * kMaxPairs; }

int rms_norm_rope_forward(const RmsNormRopeArgs& a, CUstream_st* stream) {
  if (!rms_norm_rope_supported(a.dim)) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t rows = a.batch * a.tokens * a.heads;
  if (rows <= 0) return 0;
  const auto blocks = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
  return with_element_type(a.dtype, [&](auto v) {
    using T = decltype(v);
    if (a.vectorise && vectorisable<T>(a)) {
      rms_norm_rope_vec<T><<<blocks, kWarps * 32, 0, stream>>>(a);
    } else {
      rms_norm_rope<T><<<blocks, kWarps * 32, 0, stream>>>(a);
    }
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace diffract::models::kernels
