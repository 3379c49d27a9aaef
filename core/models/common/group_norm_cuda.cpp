// The ATen side of the GroupNorm kernels: checks, scratch buffers, the current stream.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/models/common/group_norm_kernels.h"
#include "core/models/common/kernel_dtype.h"
#include "core/models/common/layers.h"  // group_norm_stats_blocks_per_sm
#include "core/util/error.h"

namespace diffract::models {

bool fused_group_norm_cuda(const at::Tensor& x, const at::Tensor& add, const at::Tensor& channel_add,
                           const at::Tensor& weight, const at::Tensor& bias, int64_t groups, double eps, bool silu,
                           at::Tensor& out) {
  if (x.dim() != 4) return false;
  kernels::GroupNormArgs a;
  const auto dtype = kernel_dtype(x.scalar_type());
  if (!dtype) return false;
  a.dtype = *dtype;
  if (x.is_contiguous()) a.channels_last = false;
  else if (x.is_contiguous(at::MemoryFormat::ChannelsLast)) a.channels_last = true;
  else return false;
  a.n = x.size(0);
  a.c = x.size(1);
  a.hw = x.size(2) * x.size(3);
  a.groups = static_cast<int>(groups);
  if (add.defined() && (add.dim() != 2 || (add.size(0) != a.n && add.size(0) != 1) || add.size(1) != a.c)) return false;
  if (channel_add.defined() && (channel_add.dim() != 1 || channel_add.size(0) != a.c)) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty_like(x);  // keeps the memory format
  if (!kernels::group_norm_supported(a, reinterpret_cast<uintptr_t>(x.data_ptr()),
                                     reinterpret_cast<uintptr_t>(y.data_ptr())))
    return false;
  const auto like_x = [&](const at::Tensor& t) { return t.to(x.device(), x.scalar_type()).contiguous(); };
  const auto w = like_x(weight), b = like_x(bias);
  // `add`'s rows may lie apart (a slice of a wider product) or be one row for all samples.
  const auto ad = !add.defined() ? at::Tensor()
                  : add.device() == x.device() && add.scalar_type() == x.scalar_type() && add.stride(1) == 1
                      ? add
                      : like_x(add);
  const auto ca = channel_add.defined() ? like_x(channel_add) : at::Tensor();
  a.sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  a.stats_blocks_per_sm = group_norm_stats_blocks_per_sm();
  a.splits = kernels::group_norm_splits(a);
  const auto f32 = x.options().dtype(at::kFloat);
  auto partial = at::empty({a.n, a.splits, a.groups, 2}, f32);
  auto stats = at::empty({a.n, a.groups, 2}, f32);
  a.x = x.data_ptr();
  a.add = ad.defined() ? ad.data_ptr() : nullptr;
  a.add_stride = ad.defined() && ad.size(0) > 1 ? ad.stride(0) : 0;
  a.channel_add = ca.defined() ? ca.data_ptr() : nullptr;
  a.weight = w.data_ptr();
  a.bias = b.data_ptr();
  a.y = y.data_ptr();
  a.partial = partial.data_ptr<float>();
  a.stats = stats.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.silu = silu;
  const int rc = kernels::group_norm_forward(a, at::cuda::getCurrentCUDAStream(x.device().index()).stream());
  if (rc != 0)
    throw Error("GroupNorm CUDA kernels failed to launch: " + std::string(cudaGetErrorString(static_cast<cudaError_t>(rc))));
  out = std::move(y);
  return true;
}

}  // namespace diffract::models
