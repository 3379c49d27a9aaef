// The ATen side of the GroupNorm kernels: checks, scratch buffers, the current stream.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/models/common/group_norm_kernels.h"
#include "core/models/common/kernel_dtype.h"
#include "core/models/common/layers.h"  // group_norm_stats_blocks_per_sm
#include "core/util/error.h"

namespace diffract::models {

namespace {

// The arguments for x (+ add [N, C] or [1, C], + channel_add [C]), its statistics over rows
// [row_begin, row_end) (row_end < 0: all), written to y (x's shape and memory format), or
// nullopt when the kernels do not take the case. `keep` holds the converted inputs the
// arguments point into.
std::optional<kernels::GroupNormArgs> args_for(const at::Tensor& x, const at::Tensor& add, const at::Tensor& channel_add,
                                                int64_t groups, const at::Tensor& y, std::vector<at::Tensor>& keep,
                                                int64_t row_begin = 0, int64_t row_end = -1) {
  if (x.dim() != 4) return std::nullopt;
  kernels::GroupNormArgs a;
  const auto dtype = kernel_dtype(x.scalar_type());
  if (!dtype) return std::nullopt;
  a.dtype = *dtype;
  if (x.is_contiguous()) a.channels_last = false;
  else if (x.is_contiguous(at::MemoryFormat::ChannelsLast)) a.channels_last = true;
  else return std::nullopt;
  a.n = x.size(0);
  a.c = x.size(1);
  a.hw = x.size(2) * x.size(3);
  a.groups = static_cast<int>(groups);
  a.stats_begin = row_begin * x.size(3);
  a.stats_end = row_end < 0 ? -1 : row_end * x.size(3);
  if (add.defined() && (add.dim() != 2 || (add.size(0) != a.n && add.size(0) != 1) || add.size(1) != a.c))
    return std::nullopt;
  if (channel_add.defined() && (channel_add.dim() != 1 || channel_add.size(0) != a.c)) return std::nullopt;
  if (!kernels::group_norm_supported(a, reinterpret_cast<uintptr_t>(x.data_ptr()),
                                     reinterpret_cast<uintptr_t>(y.defined() ? y.data_ptr() : x.data_ptr())))
    return std::nullopt;
  const auto like_x = [&](const at::Tensor& t) { return t.to(x.device(), x.scalar_type()).contiguous(); };
  // `add`'s rows may lie apart (a slice of a wider product) or be one row for all samples.
  if (add.defined()) {
    keep.push_back(add.device() == x.device() && add.scalar_type() == x.scalar_type() && add.stride(1) == 1 ? add
                                                                                                        : like_x(add));
    a.add = keep.back().data_ptr();
    a.add_stride = keep.back().size(0) > 1 ? keep.back().stride(0) : 0;
  }
  if (channel_add.defined()) {
    keep.push_back(like_x(channel_add));
    a.channel_add = keep.back().data_ptr();
  }
  a.sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  a.stats_blocks_per_sm = group_norm_stats_blocks_per_sm();
  a.x = x.data_ptr();
  a.y = y.defined() ? y.data_ptr() : nullptr;
  return a;
}

void check_launch(int rc, const char* what) {
  if (rc != 0)
    throw Error(std::string(what) + " failed to launch: " + cudaGetErrorString(static_cast<cudaError_t>(rc)));
}

cudaStream_t stream_of(const at::Tensor& x) { return at::cuda::getCurrentCUDAStream(x.device().index()).stream(); }

void set_affine(kernels::GroupNormArgs& a, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                std::vector<at::Tensor>& keep) {
  keep.push_back(weight.to(x.device(), x.scalar_type()).contiguous());
  a.weight = keep.back().data_ptr();
  keep.push_back(bias.to(x.device(), x.scalar_type()).contiguous());
  a.bias = keep.back().data_ptr();
}

}  // namespace

bool fused_group_norm_cuda(const at::Tensor& x, const at::Tensor& add, const at::Tensor& channel_add,
                           const at::Tensor& weight, const at::Tensor& bias, int64_t groups, double eps, bool silu,
                           at::Tensor& out) {
  if (x.dim() != 4) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty_like(x);  // keeps the memory format
  std::vector<at::Tensor> keep;
  auto a = args_for(x, add, channel_add, groups, y, keep);
  if (!a) return false;
  set_affine(*a, x, weight, bias, keep);
  a->splits = kernels::group_norm_splits(*a);
  const auto f32 = x.options().dtype(at::kFloat);
  auto partial = at::empty({a->n, a->splits, a->groups, 2}, f32);
  auto stats = at::empty({a->n, a->groups, 2}, f32);
  a->partial = partial.data_ptr<float>();
  a->stats = stats.data_ptr<float>();
  a->eps = static_cast<float>(eps);
  a->silu = silu;
  check_launch(kernels::group_norm_forward(*a, stream_of(x)), "GroupNorm CUDA kernels");
  out = std::move(y);
  return true;
}

bool group_norm_moments_cuda(const at::Tensor& x, const at::Tensor& add, int64_t groups, int64_t row_begin,
                             int64_t row_end, at::Tensor& moments) {
  if (x.dim() != 4) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> keep;
  auto a = args_for(x, add, {}, groups, {}, keep, row_begin, row_end);
  if (!a) return false;
  a->splits = kernels::group_norm_splits(*a);
  const auto f32 = x.options().dtype(at::kFloat);
  auto partial = at::empty({a->n, a->splits, a->groups, 2}, f32);
  moments = at::empty({a->n, a->groups, 2}, f32);
  a->partial = partial.data_ptr<float>();
  a->stats = moments.data_ptr<float>();
  check_launch(kernels::group_norm_moments(*a, stream_of(x)), "GroupNorm moments kernels");
  return true;
}

bool group_norm_apply_cuda(const at::Tensor& x, const at::Tensor& add, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& stats, int64_t groups, bool silu, at::Tensor& out) {
  if (x.dim() != 4) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  std::vector<at::Tensor> keep;
  auto a = args_for(x, add, {}, groups, y, keep);
  if (!a) return false;
  set_affine(*a, x, weight, bias, keep);
  keep.push_back(stats.to(x.device(), at::kFloat).contiguous());
  if (keep.back().numel() != a->n * a->groups * 2)
    throw Error("GroupNorm: statistics of shape " + c10::str(stats.sizes()) + " for input " + c10::str(x.sizes()) +
                " with " + std::to_string(groups) + " groups (wants [N, groups, 2])");
  a->stats = keep.back().data_ptr<float>();
  a->silu = silu;
  check_launch(kernels::group_norm_apply(*a, stream_of(x)), "GroupNorm normalisation kernel");
  out = std::move(y);
  return true;
}

at::Tensor group_norm_combine_cuda(const at::Tensor& moments, const std::vector<double>& counts, double eps) {
  const c10::cuda::CUDAGuard guard(moments.device());
  const auto m = moments.to(at::kFloat).contiguous();
  kernels::MomentsCombineArgs a;
  a.parts = static_cast<int>(counts.size());
  if (a.parts > kernels::kMaxMomentParts)
    throw Error("GroupNorm: " + std::to_string(a.parts) + " parts' moments to combine (at most " +
                std::to_string(kernels::kMaxMomentParts) + ")");
  a.rows = a.parts > 0 ? m.numel() / (2 * a.parts) : 0;
  for (int p = 0; p < a.parts; ++p) a.counts[p] = counts[static_cast<std::size_t>(p)];
  auto stats = at::empty(m.sizes().slice(1), m.options());
  a.moments = m.data_ptr<float>();
  a.stats = stats.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  check_launch(kernels::group_norm_combine(a, stream_of(m)), "GroupNorm moments combination kernel");
  return stats;
}

}  // namespace diffract::models
