#include "core/models/common/group_norm_kernels.h"

#include <algorithm>
#include <cstddef>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/models/common/kernel_types.cuh"

namespace diffract::models::kernels {
namespace {

constexpr int kVecBytes = 16;
constexpr int kThreads = 256;
constexpr std::size_t kMaxStatsShared = 48 << 10;  // without opting in to more

// stats_nhwc's shared memory: two floats per channel for each of its k thread rows.
std::size_t nhwc_stats_shared_bytes(int64_t c, int64_t cols) {
  return 2 * static_cast<std::size_t>(std::max<int64_t>(1, kThreads / cols)) * static_cast<std::size_t>(c) * sizeof(float);
}

template <typename T>
struct alignas(kVecBytes) Vec {
  static constexpr int size = kVecBytes / sizeof(T);
  T v[size];
};

// What is added to channel c of sample n before normalising.
template <typename T>
__device__ __forceinline__ float added(const GroupNormArgs& a, int64_t n, int64_t c) {
  float s = 0.f;
  if (a.add) s = to_float(static_cast<const T*>(a.add)[n * a.add_stride + c]);
  if (a.channel_add) s += to_float(static_cast<const T*>(a.channel_add)[c]);
  return s;
}

// The statistics are sums of (x - shift), shift = the group's first value, so that a group whose
// mean is large against its spread keeps its variance in fp32.
template <typename T>
__device__ __forceinline__ float group_shift(const GroupNormArgs& a, int64_t n, int g) {
  const int64_t cg = a.c / a.groups;
  const int64_t c0 = g * cg;
  const T* x = static_cast<const T*>(a.x);
  const int64_t at = a.channels_last ? (n * a.hw * a.c + c0) : ((n * a.c + c0) * a.hw);
  return to_float(x[at]) + added<T>(a, n, c0);
}

__host__ __device__ __forceinline__ int64_t stats_range(const GroupNormArgs& a) {
  return (a.stats_end < 0 ? a.hw : a.stats_end) - a.stats_begin;
}

__device__ __forceinline__ void block_sum2(float& s, float& q) {
  __shared__ float ws[2][kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    q += __shfl_xor_sync(0xffffffffu, q, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) { ws[0][warp] = s; ws[1][warp] = q; }
  __syncthreads();
  if (warp == 0) {
    const int warps = (blockDim.x + 31) / 32;
    s = lane < warps ? ws[0][lane] : 0.f;
    q = lane < warps ? ws[1][lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) {
      s += __shfl_xor_sync(0xffffffffu, s, o);
      q += __shfl_xor_sync(0xffffffffu, q, o);
    }
  }
}

// NCHW: grid (splits, groups, N). A group is one contiguous run of C/G * HW values (C/G runs of
// the statistics' pixels when they are not all of HW); each block sums a slice of it.
template <typename T>
__global__ void stats_nchw(GroupNormArgs a) {
  using V = Vec<T>;
  const int s = blockIdx.x, g = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int64_t cg = a.c / a.groups;
  const int64_t per_channel = stats_range(a) / V::size;
  const bool whole = per_channel * V::size == a.hw;
  const int64_t vectors = cg * per_channel;
  const int64_t chunk = (vectors + a.splits - 1) / a.splits;
  const int64_t v0 = s * chunk, v1 = min(vectors, v0 + chunk);
  const V* x = reinterpret_cast<const V*>(static_cast<const T*>(a.x) + (n * a.c + g * cg) * a.hw + a.stats_begin);
  const int64_t channel_vectors = a.hw / V::size;
  const bool adds = a.add || a.channel_add;
  const float shift = group_shift<T>(a, n, g);
  float sum = 0.f, sq = 0.f;
  for (int64_t v = v0 + threadIdx.x; v < v1; v += blockDim.x) {
    int64_t at = v, ch = 0;
    if (!whole) {
      ch = v / per_channel;
      at = ch * channel_vectors + (v - ch * per_channel);
    } else if (adds) {
      ch = v / channel_vectors;
    }
    const V in = x[at];
    const float b = (adds ? added<T>(a, n, g * cg + ch) : 0.f) - shift;
#pragma unroll
    for (int j = 0; j < V::size; ++j) {
      const float d = to_float(in.v[j]) + b;
      sum += d;
      sq += d * d;
    }
  }
  block_sum2(sum, sq);
  if (threadIdx.x == 0) {
    float* p = a.partial + ((n * a.splits + s) * a.groups + g) * 2;
    p[0] = sum;
    p[1] = sq;
  }
}

// NHWC: grid (splits, N); block = C/vec columns x k rows. Each thread keeps one vector of
// channels over a slice of the rows; the block then adds each channel's k rows, and each
// group's channels, in a fixed order through shared memory (float atomics there would add in
// whatever order the threads arrive: the same input gave different bits from run to run).
template <typename T>
__global__ void stats_nhwc(GroupNormArgs a) {
  using V = Vec<T>;
  extern __shared__ float part[];  // [2][k][C]: sums and sums of squares per thread row and channel
  const int s = blockIdx.x;
  const int64_t n = blockIdx.y;
  const int c = static_cast<int>(a.c);
  const int cols = c / V::size;
  const int k = blockDim.x / cols;
  const int cg = c / a.groups;
  float* psum = part;
  float* psq = part + k * c;
  const int col = threadIdx.x % cols, row = threadIdx.x / cols;
  if (row < k) {
    const int64_t range = stats_range(a);
    const int64_t chunk = (range + a.splits - 1) / a.splits;
    const int64_t r0 = a.stats_begin + s * chunk, r1 = min(a.stats_begin + range, r0 + chunk);
    const int c0 = col * V::size;
    float b[V::size], sum[V::size], sq[V::size];
#pragma unroll
    for (int j = 0; j < V::size; ++j) {
      b[j] = added<T>(a, n, c0 + j) - group_shift<T>(a, n, (c0 + j) / cg);
      sum[j] = sq[j] = 0.f;
    }
    const V* x = reinterpret_cast<const V*>(static_cast<const T*>(a.x) + n * a.hw * a.c) + col;
    for (int64_t r = r0 + row; r < r1; r += k) {
      const V in = x[r * cols];
#pragma unroll
      for (int j = 0; j < V::size; ++j) {
        const float d = to_float(in.v[j]) + b[j];
        sum[j] += d;
        sq[j] += d * d;
      }
    }
#pragma unroll
    for (int j = 0; j < V::size; ++j) {
      psum[row * c + c0 + j] = sum[j];
      psq[row * c + c0 + j] = sq[j];
    }
  }
  __syncthreads();
  for (int ch = threadIdx.x; ch < c; ch += blockDim.x) {  // row 0's slot takes the channel's total
    float cs = 0.f, cq = 0.f;
    for (int r = 0; r < k; ++r) {
      cs += psum[r * c + ch];
      cq += psq[r * c + ch];
    }
    psum[ch] = cs;
    psq[ch] = cq;
  }
  __syncthreads();
  for (int g = threadIdx.x; g < a.groups; g += blockDim.x) {
    float gs = 0.f, gq = 0.f;
    for (int ch = g * cg; ch < (g + 1) * cg; ++ch) {
      gs += psum[ch];
      gq += psq[ch];
    }
    float* p = a.partial + ((n * a.splits + s) * a.groups + g) * 2;
    p[0] = gs;
    p[1] = gq;
  }
}

// One warp per (sample, group): the lanes sum every 32nd split, then a butterfly adds the lanes
// -> mean and 1 / std (Moments: mean and variance). The order is fixed (deterministic) and the
// splits' loads are in flight together; one thread per group adding them one after another
// (264 splits for SDXL's NHWC tensors at batch 2) measured slower (docs/benchmarks.md).
template <typename T, bool Moments>
__global__ void finalize(GroupNormArgs a) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= a.n * a.groups) return;  // whole warps: blockDim is a multiple of 32
  const int64_t n = w / a.groups;
  const int g = static_cast<int>(w % a.groups);
  const float2* p = reinterpret_cast<const float2*>(a.partial) + n * a.splits * a.groups + g;
  float sum = 0.f, sq = 0.f;
  for (int s = lane; s < a.splits; s += 32) {
    const float2 v = p[static_cast<int64_t>(s) * a.groups];
    sum += v.x;
    sq += v.y;
  }
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
    sq += __shfl_xor_sync(0xffffffffu, sq, o);
  }
  if (lane == 0) {
    const float count = static_cast<float>(a.c / a.groups * stats_range(a));
    const float m = sum / count;
    const float var = fmaxf(sq / count - m * m, 0.f);
    a.stats[(n * a.groups + g) * 2] = group_shift<T>(a, n, g) + m;
    a.stats[(n * a.groups + g) * 2 + 1] = Moments ? var : rsqrtf(var + a.eps);
  }
}

template <typename T>
__global__ void apply(GroupNormArgs a) {
  using V = Vec<T>;
  const int64_t vectors = a.n * a.c * a.hw / V::size;
  const int64_t cg = a.c / a.groups;
  const bool adds = a.add || a.channel_add;
  const T* w = static_cast<const T*>(a.weight);
  const T* bias = static_cast<const T*>(a.bias);
  const V* x = static_cast<const V*>(a.x);
  V* y = static_cast<V*>(a.y);
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vectors;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = v * V::size;
    const V in = x[v];
    V out;
    if (a.channels_last) {
      const int64_t n = i / (a.hw * a.c), c0 = i % a.c;
#pragma unroll
      for (int j = 0; j < V::size; ++j) {
        const int64_t c = c0 + j;
        const float* st = a.stats + (n * a.groups + c / cg) * 2;
        float h = to_float(in.v[j]) + (adds ? added<T>(a, n, c) : 0.f);
        h = (h - st[0]) * st[1] * to_float(w[c]) + to_float(bias[c]);
        if (a.silu) h = h / (1.f + __expf(-h));
        out.v[j] = from_float<T>(h);
      }
    } else {
      const int64_t nc = i / a.hw, c = nc % a.c, n = nc / a.c;
      const float* st = a.stats + (n * a.groups + c / cg) * 2;
      const float scale = st[1] * to_float(w[c]);
      const float shift = to_float(bias[c]) - (st[0] - (adds ? added<T>(a, n, c) : 0.f)) * scale;
#pragma unroll
      for (int j = 0; j < V::size; ++j) {
        float h = to_float(in.v[j]) * scale + shift;
        if (a.silu) h = h / (1.f + __expf(-h));
        out.v[j] = from_float<T>(h);
      }
    }
    y[v] = out;
  }
}

// One thread per row: the parts' means and variances (Chan et al.) in double.
__global__ void combine_moments(MomentsCombineArgs a) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= a.rows) return;
  double total = 0, mean = 0;
  for (int p = 0; p < a.parts; ++p) {
    total += a.counts[p];
    mean += a.counts[p] * static_cast<double>(a.moments[(p * a.rows + row) * 2]);
  }
  mean /= total;
  double var = 0;
  for (int p = 0; p < a.parts; ++p) {
    const double d = static_cast<double>(a.moments[(p * a.rows + row) * 2]) - mean;
    var += a.counts[p] * (static_cast<double>(a.moments[(p * a.rows + row) * 2 + 1]) + d * d);
  }
  var /= total;
  a.stats[row * 2] = static_cast<float>(mean);
  a.stats[row * 2 + 1] = static_cast<float>(1.0 / sqrt(var + a.eps));
}

template <typename T>
void launch_stats(const GroupNormArgs& a, cudaStream_t stream) {
  if (a.channels_last) {
    const int cols = static_cast<int>(a.c / Vec<T>::size);
    const int k = std::max(1, kThreads / cols);
    stats_nhwc<T><<<dim3(a.splits, a.n), cols * k, nhwc_stats_shared_bytes(a.c, cols), stream>>>(a);
  } else {
    stats_nchw<T><<<dim3(a.splits, a.groups, a.n), kThreads, 0, stream>>>(a);
  }
}

template <typename T, bool Moments>
void launch_finalize(const GroupNormArgs& a, cudaStream_t stream) {
  const int64_t finalize_blocks = (a.n * a.groups * 32 + kThreads - 1) / kThreads;
  finalize<T, Moments><<<static_cast<unsigned>(finalize_blocks), kThreads, 0, stream>>>(a);
}

template <typename T>
void launch_apply(const GroupNormArgs& a, cudaStream_t stream) {
  const int64_t vectors = a.n * a.c * a.hw / Vec<T>::size;
  const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads, 16LL * std::max(a.sm_count, 1));
  apply<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
}

// What: 1 the statistics and the normalisation, 2 the moments only, 3 the normalisation only.
template <typename T>
int launch(const GroupNormArgs& a, cudaStream_t stream, int what) {
  if (what != 3) launch_stats<T>(a, stream);
  if (what == 1) launch_finalize<T, false>(a, stream);
  if (what == 2) launch_finalize<T, true>(a, stream);
  if (what != 2) launch_apply<T>(a, stream);
  return static_cast<int>(cudaGetLastError());
}

int dispatch(const GroupNormArgs& a, CUstream_st* stream, int what) {
  return with_element_type(a.dtype, [&](auto v) { return launch<decltype(v)>(a, stream, what); });
}

int vec_size(DType t) { return t == DType::Float ? kVecBytes / 4 : kVecBytes / 2; }

}  // namespace

bool group_norm_supported(const GroupNormArgs& a, uintptr_t x_address, uintptr_t y_address) {
  const int vec = vec_size(a.dtype);
  if (a.n < 1 || a.c < 1 || a.hw < 1 || a.groups < 1 || a.c % a.groups != 0) return false;
  if (x_address % kVecBytes != 0 || y_address % kVecBytes != 0) return false;
  const int64_t range = stats_range(a);
  if (a.stats_begin < 0 || range < 1 || a.stats_begin + range > a.hw) return false;
  if (a.channels_last)
    return a.c % vec == 0 && a.c / vec <= 1024 && a.groups <= 4096 && nhwc_stats_shared_bytes(a.c, a.c / vec) <= kMaxStatsShared;
  return a.hw % vec == 0 && a.stats_begin % vec == 0 && range % vec == 0 && a.groups <= 65535 && a.n <= 65535;
}

int group_norm_splits(const GroupNormArgs& a) {
  const int64_t target = static_cast<int64_t>(std::max(a.stats_blocks_per_sm, 1)) * std::max(a.sm_count, 1);
  const int vec = vec_size(a.dtype);
  int64_t s;
  if (a.channels_last) {
    const int64_t cols = a.c / vec, k = std::max<int64_t>(1, kThreads / cols);
    s = std::min((target + a.n - 1) / a.n, (stats_range(a) + k - 1) / k);  // at least one row per thread row
  } else {
    const int64_t vectors = a.c / a.groups * stats_range(a) / vec;
    s = std::min((target + a.n * a.groups - 1) / (a.n * a.groups), (vectors + kThreads - 1) / kThreads);
  }
  return static_cast<int>(std::clamp<int64_t>(s, 1, 65535));
}

int group_norm_forward(const GroupNormArgs& a, CUstream_st* stream) { return dispatch(a, stream, 1); }
int group_norm_moments(const GroupNormArgs& a, CUstream_st* stream) { return dispatch(a, stream, 2); }
int group_norm_apply(const GroupNormArgs& a, CUstream_st* stream) { return dispatch(a, stream, 3); }

int group_norm_combine(const MomentsCombineArgs& a, CUstream_st* stream) {
  if (a.parts < 1 || a.parts > kMaxMomentParts || a.rows < 1) return static_cast<int>(cudaErrorInvalidValue);
  combine_moments<<<static_cast<unsigned>((a.rows + 127) / 128), 128, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace diffract::models::kernels
