#pragma once
// GroupNorm (+ per-channel adds before it, + SiLU after it) as three CUDA kernels, for NCHW
// and NHWC (channels-last) tensors. Plain C++ over raw pointers, so the .cu needs no torch
// headers; models::GroupNorm (layers.h) is the only caller.
//
// Why: ATen's GroupNorm reduces each (sample, group) row with one thread block (RowwiseMoments):
// 64 blocks for SDXL's UNet at batch 2, 32 for the VAE at batch 1, on a GPU with 132 SMs.
// That leaves most SMs idle, and its NHWC input is first copied to NCHW, which is why
// channels-last loses for SDXL. Here the statistics are split over ~2 blocks per SM and summed
// in a fixed order (deterministic), the add and the SiLU ride along in the same passes, and
// channels-last tensors stay channels-last.
#include <cstdint>

struct CUstream_st;

namespace diffract::models::kernels {

enum class DType { Float, Half, BFloat16 };

struct GroupNormArgs {
  const void* x = nullptr;       // [N, C, HW] or [N, HW, C] (channels_last), dtype
  // Optional, dtype: x + add[n, c] + channel_add[c] is what is normalised.
  const void* add = nullptr;          // [N, C], rows add_stride elements apart (0: one row for all)
  const void* channel_add = nullptr;  // [C]
  const void* weight = nullptr;  // [C], dtype
  const void* bias = nullptr;    // [C], dtype
  void* y = nullptr;             // like x
  float* partial = nullptr;      // [N, splits, groups, 2] scratch
  float* stats = nullptr;        // [N, groups, 2] scratch: mean, 1 / std
  int64_t n = 0, c = 0, hw = 0, add_stride = 0;
  // The pixels [stats_begin, stats_end) of HW that the statistics read (stats_end < 0: all of
  // them); the normalisation still writes every pixel. NCHW: multiples of the vector.
  int64_t stats_begin = 0, stats_end = -1;
  int groups = 0, splits = 1;
  int sm_count = 1;  // the GPU's, for the grid sizes
  int stats_blocks_per_sm = 2;  // how many statistics blocks (splits x N) to aim for per SM
  float eps = 1e-5f;
  bool silu = false;
  bool channels_last = false;
  DType dtype = DType::Float;
};

// Whether the kernels take this case: x and y 16-byte aligned, HW (NCHW) or C (NHWC) a multiple
// of the 16-byte vector, C / groups whole; NHWC: C <= 6144 in half types (the statistics' shared
// memory), 4096 in float. The caller falls back to ATen.
bool group_norm_supported(const GroupNormArgs& a, uintptr_t x_address, uintptr_t y_address);
// The split count for `partial`, from the problem and the GPU's SM count.
int group_norm_splits(const GroupNormArgs& a);
// Launches the three kernels on `stream`; returns the CUDA error code of the launches (0: ok).
int group_norm_forward(const GroupNormArgs& a, CUstream_st* stream);

// The two halves of group_norm_forward, for a normalisation whose statistics come from several
// devices (a row-band decode, core/parallel/parallel_vae.h): moments() writes stats[n, g] =
// (mean, biased variance) of the statistics' pixels; apply() normalises every pixel with
// stats[n, g] = (mean, 1 / std) given. Same return codes.
int group_norm_moments(const GroupNormArgs& a, CUstream_st* stream);
int group_norm_apply(const GroupNormArgs& a, CUstream_st* stream);

// Several parts' moments -> the whole's statistics: moments [parts, rows, 2] (mean, variance
// of each part, fp32) and each part's element count -> stats [rows, 2] (mean, 1 / sqrt(variance
// + eps)), combined in double, parts in order (the same numbers on every device).
constexpr int kMaxMomentParts = 16;
struct MomentsCombineArgs {
  const float* moments = nullptr;
  float* stats = nullptr;
  int64_t rows = 0;
  int parts = 0;
  double counts[kMaxMomentParts] = {};
  float eps = 1e-5f;
};
int group_norm_combine(const MomentsCombineArgs& a, CUstream_st* stream);

}  // namespace diffract::models::kernels
