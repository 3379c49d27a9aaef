#include "core/models/common/layer_norm_kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/models/common/fp8_rows.cuh"
#include "core/models/common/kernel_types.cuh"

namespace diffract::models::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kPer = 8;  // 16-byte vectors of fp16 / bf16
constexpr int64_t kMaxBlocks = int64_t(1) << 30;

template <typename T>
struct alignas(16) Vec {
  T v[kPer];
};

// The sum (kMax: the maximum) over one row's threads, the same value in each of them. The row's
// warps meet in `red` (one slot per warp), read back in one order by every thread.
template <int kWarpsPerRow, bool kMax = false>
__device__ __forceinline__ float row_reduce(float v, float* red) {
  const auto op = [](float a, float b) { return kMax ? fmaxf(a, b) : a + b; };
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if constexpr (kWarpsPerRow == 1) {
    return v;
  } else {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) red[warp] = v;
    __syncthreads();
    const int first = warp / kWarpsPerRow * kWarpsPerRow;
    float total = kMax ? v : 0.f;
#pragma unroll
    for (int k = 0; k < kWarpsPerRow; ++k) total = op(total, red[first + k]);
    __syncthreads();  // `red` is written again by the next reduction
    return total;
  }
}

// ATen's rounding of a value to T and back (the separate ops this kernel stands in for).
template <typename T>
__device__ __forceinline__ float rounded(float v) {
  return to_float(from_float<T>(v));
}

// Block = kThreads / (32 * kWarpsPerRow) rows; thread t of a row holds vectors t, t + row
// threads, ... (kVpt of them at most). Rows past the end still take part in the block's
// barriers, so the loop stays uniform over the block. kMod: the modulated form (scale and shift
// per batch item, the residual gated where a gate is given: uniform over the launch, so no
// divergence); without it the affine kernel the UNets run, unchanged by the modulated one.
template <typename T, int kVpt, int kWarpsPerRow, bool kAdd, bool kPrefetch, bool kMod, bool kFp8>
__global__ void layer_norm(LayerNormArgs a) {
  using V = Vec<T>;
  constexpr int kRowThreads = 32 * kWarpsPerRow;
  constexpr int kRowsPerBlock = kThreads / kRowThreads;
  __shared__ float red[kThreads / 32];
  const int slot = threadIdx.x / kRowThreads, t = threadIdx.x % kRowThreads;
  const int vectors = static_cast<int>(a.c / kPer);
  const float inv_c = 1.f / static_cast<float>(a.c);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; base < a.rows;
       base += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t row = base + slot;
    const bool live = row < a.rows;
    const int64_t batch = kMod && live ? row / a.rows_per_batch : 0;
    const V* __restrict__ w = static_cast<const V*>(a.weight);
    const V* __restrict__ b = static_cast<const V*>(a.bias);
    if constexpr (kMod) w += batch * (a.scale_stride / kPer), b += batch * (a.shift_stride / kPer);
    const V* __restrict__ x = static_cast<const V*>(a.x) + row * vectors;
    V in[kVpt], wv[kVpt], bv[kVpt];
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kVpt; ++i) {
      const int v = t + i * kRowThreads;
      if (live && v < vectors) {
        in[i] = x[v];
        // The affine's loads go out with x's, not after the two reductions.
        if constexpr (kPrefetch) wv[i] = w[v], bv[i] = b[v];
        if constexpr (kAdd) {
          const V r = static_cast<const V*>(a.residual)[row * vectors + v];
          if (kMod && a.gate) {
            const V g = static_cast<const V*>(a.gate)[batch * (a.gate_stride / kPer) + v];
#pragma unroll
            for (int j = 0; j < kPer; ++j)
              in[i].v[j] = from_float<T>(to_float(in[i].v[j]) + rounded<T>(to_float(g.v[j]) * to_float(r.v[j])));
          } else {
#pragma unroll
            for (int j = 0; j < kPer; ++j) in[i].v[j] = from_float<T>(to_float(in[i].v[j]) + to_float(r.v[j]));
          }
          static_cast<V*>(a.sum)[row * vectors + v] = in[i];
        }
#pragma unroll
        for (int j = 0; j < kPer; ++j) sum += to_float(in[i].v[j]);
      }
    }
    // f(value) for each value this thread holds of the row.
    const auto each_held = [&](auto&& f) {
#pragma unroll
      for (int i = 0; i < kVpt; ++i) {
        const int v = t + i * kRowThreads;
        if (live && v < vectors) {
#pragma unroll
          for (int j = 0; j < kPer; ++j) f(to_float(in[i].v[j]));
        }
      }
    };
    const float mean = row_reduce<kWarpsPerRow>(sum, red) * inv_c;
    float sq = 0.f;
    each_held([&](float e) {
      const float d = e - mean;
      sq += d * d;
    });
    const float rstd = rsqrtf(row_reduce<kWarpsPerRow>(sq, red) * inv_c + a.eps);
    V* __restrict__ y = static_cast<V*>(a.y) + row * vectors;
#pragma unroll
    for (int i = 0; i < kVpt; ++i) {
      const int v = t + i * kRowThreads;
      if (live && v < vectors) {
        if constexpr (!kPrefetch) wv[i] = w[v], bv[i] = b[v];
        V out;
        if constexpr (kMod) {
#pragma unroll
          for (int j = 0; j < kPer; ++j) {
            const float n = rounded<T>((to_float(in[i].v[j]) - mean) * rstd);
            const float scaled = rounded<T>(n * rounded<T>(1.f + to_float(wv[i].v[j])));
            out.v[j] = from_float<T>(scaled + to_float(bv[i].v[j]));
          }
        } else {
#pragma unroll
          for (int j = 0; j < kPer; ++j)
            out.v[j] =
                from_float<T>((to_float(in[i].v[j]) - mean) * rstd * to_float(wv[i].v[j]) + to_float(bv[i].v[j]));
        }
        y[v] = out;
        if constexpr (kFp8) in[i] = out;
      }
    }
    if constexpr (kFp8) {
      float amax = 0.f;
      each_held([&](float e) { amax = fmaxf(amax, fabsf(e)); });
      const float s = e4m3_row_scale(row_reduce<kWarpsPerRow, true>(amax, red));
      const float inv = 1.f / s;
      if (live && t == 0) a.q_scale[row] = s;
      uint2* __restrict__ q = static_cast<uint2*>(a.q) + row * vectors;
#pragma unroll
      for (int i = 0; i < kVpt; ++i) {
        const int v = t + i * kRowThreads;
        if (live && v < vectors) q[v] = e4m3x8(in[i].v, inv);
      }
    }
  }
}

// A block per row (grid-stride over rows), its threads over the row's vectors of kPer values:
// the batch item and the gate's row are found once per row, not per vector.
template <typename T>
__global__ void gated_residual(GatedResidualArgs a) {
  using V = Vec<T>;
  const int vectors = static_cast<int>(a.c / kPer);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const V* __restrict__ x = static_cast<const V*>(a.x) + row * vectors;
    const V* __restrict__ y = static_cast<const V*>(a.y) + row * vectors;
    const V* __restrict__ gate = static_cast<const V*>(a.gate) + row / a.rows_per_batch * (a.gate_stride / kPer);
    V* out = static_cast<V*>(a.out) + row * vectors;
    for (int v = threadIdx.x; v < vectors; v += blockDim.x) {
      const V xv = x[v], yv = y[v], g = gate[v];
      V o;
#pragma unroll
      for (int j = 0; j < kPer; ++j)
        o.v[j] = from_float<T>(to_float(xv.v[j]) + rounded<T>(to_float(g.v[j]) * to_float(yv.v[j])));
      out[v] = o;
    }
  }
}

template <typename T, int kVpt, int kWarpsPerRow>
int launch(const LayerNormArgs& a, cudaStream_t stream) {
  constexpr int64_t rows_per_block = kThreads / (32 * kWarpsPerRow);
  const int64_t blocks = std::min((a.rows + rows_per_block - 1) / rows_per_block, kMaxBlocks);
  const auto grid = static_cast<unsigned>(blocks);
  // With at most ~2 blocks per SM the kernel is latency-bound (SDXL's 1024-row LayerNorms at
  // batch 1): weight and bias are loaded with x, off the critical path after the reductions.
  // With more rows, doing so costs time (registers, the loads competing with x's): measured
  // slower at SDXL's batch 2, faster at batch 1 (docs/benchmarks.md).
  const bool prefetch = blocks <= 2LL * a.sm_count;
  // The e4m3 rows: bf16 only (fp8 GEMMs take bf16 models), a form of its own so that the others
  // keep their registers.
  const auto go = [&](auto add, auto pre) {
    const auto with = [&](auto mod) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        if (a.q) {
          layer_norm<T, kVpt, kWarpsPerRow, add.value, pre.value, mod.value, true><<<grid, kThreads, 0, stream>>>(a);
          return;
        }
      }
      layer_norm<T, kVpt, kWarpsPerRow, add.value, pre.value, mod.value, false><<<grid, kThreads, 0, stream>>>(a);
    };
    if (a.rows_per_batch > 0) with(std::true_type{});
    else with(std::false_type{});
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (a.residual) prefetch ? go(Yes{}, Yes{}) : go(Yes{}, No{});
  else prefetch ? go(No{}, Yes{}) : go(No{}, No{});
  return static_cast<int>(cudaGetLastError());
}

// One warp per row up to 1280 values (SDXL's widest), so that no lane waits on a barrier;
// longer rows spread over 2 or 4 warps to keep the registers per thread down.
template <typename T>
int dispatch(const LayerNormArgs& a, cudaStream_t stream) {
  const int64_t v = a.c / kPer;
  if (a.warps_per_row == 2) {
    if (v <= 64) return launch<T, 1, 2>(a, stream);
    if (v <= 128) return launch<T, 2, 2>(a, stream);
    if (v <= 192) return launch<T, 3, 2>(a, stream);
  } else if (a.warps_per_row == 4) {
    if (v <= 128) return launch<T, 1, 4>(a, stream);
    if (v <= 256) return launch<T, 2, 4>(a, stream);
  }
  if (v <= 32) return launch<T, 1, 1>(a, stream);
  if (v <= 64) return launch<T, 2, 1>(a, stream);
  if (v <= 96) return launch<T, 3, 1>(a, stream);
  if (v <= 128) return launch<T, 4, 1>(a, stream);
  if (v <= 160) return launch<T, 5, 1>(a, stream);
  if (v <= 256) return launch<T, 4, 2>(a, stream);
  if (v <= 512) return launch<T, 4, 4>(a, stream);
  return launch<T, 8, 4>(a, stream);
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool layer_norm_supported(DType dtype, int64_t c) {
  return (dtype == DType::Half || dtype == DType::BFloat16) && c >= kPer && c % kPer == 0 && c <= kLayerNormMaxC;
}

int layer_norm_forward(const LayerNormArgs& a, CUstream_st* stream) {
  const bool strides_ok = a.rows_per_batch == 0 ? a.gate == nullptr
                                                 : a.rows_per_batch > 0 && a.scale_stride % kPer == 0 &&
                                                       a.shift_stride % kPer == 0 && a.gate_stride % kPer == 0 &&
                                                       a.scale_stride >= 0 && a.shift_stride >= 0 && a.gate_stride >= 0;
  if (!layer_norm_supported(a.dtype, a.c) || a.rows < 1 || !aligned(a.x) || !aligned(a.weight) || !aligned(a.bias) ||
      !aligned(a.y) || (a.residual == nullptr) != (a.sum == nullptr) || (a.residual && (!aligned(a.residual) || !aligned(a.sum))) ||
      !strides_ok || (a.gate && (!a.residual || !aligned(a.gate))) || (a.q == nullptr) != (a.q_scale == nullptr) ||
      reinterpret_cast<uintptr_t>(a.q) % 8 != 0 || (a.q && a.dtype != DType::BFloat16))
    return static_cast<int>(cudaErrorInvalidValue);
  // layer_norm_supported() took Half and BFloat16 only.
  return with_element_type(a.dtype, [&](auto v) -> int {
    if constexpr (std::is_same_v<decltype(v), float>) return static_cast<int>(cudaErrorInvalidValue);
    else return dispatch<decltype(v)>(a, stream);
  });
}

int gated_residual_forward(const GatedResidualArgs& a, CUstream_st* stream) {
  if ((a.dtype != DType::Half && a.dtype != DType::BFloat16) || a.c < kPer || a.c % kPer != 0 || a.rows < 1 ||
      a.rows_per_batch < 1 || a.gate_stride < 0 || a.gate_stride % kPer != 0 || !aligned(a.x) || !aligned(a.y) ||
      !aligned(a.gate) || !aligned(a.out))
    return static_cast<int>(cudaErrorInvalidValue);
  // Up to 256 threads, a whole number of warps covering the row's vectors where it fits.
  const int64_t vectors = a.c / kPer;
  const auto threads = static_cast<unsigned>(std::min<int64_t>(256, (vectors + 31) / 32 * 32));
  const auto grid = static_cast<unsigned>(std::min(a.rows, kMaxBlocks));
  return with_element_type(a.dtype, [&](auto v) -> int {
    if constexpr (std::is_same_v<decltype(v), float>) {
      return static_cast<int>(cudaErrorInvalidValue);
    } else {
      gated_residual<decltype(v)><<<grid, threads, 0, stream>>>(a);
      return static_cast<int>(cudaGetLastError());
    }
  });
}

}  // namespace diffract::models::kernels
