#include "core/models/common/patch_parallel.h"

#include <string>

#include <ATen/ATen.h>

#include "core/models/common/layers.h"
#include "core/util/error.h"

namespace diffract::models {

namespace {
thread_local PatchContext* t_context = nullptr;
}  // namespace

#ifdef DIFFRACT_HAS_CUDA_KERNELS
// group_norm_cuda.cpp: false when the kernels do not take the case.
bool group_norm_moments_cuda(const at::Tensor& x, const at::Tensor& add, int64_t groups, int64_t row_begin,
                             int64_t row_end, at::Tensor& moments);
bool group_norm_apply_cuda(const at::Tensor& x, const at::Tensor& add, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& stats, int64_t groups, bool silu, at::Tensor& out);
at::Tensor group_norm_combine_cuda(const at::Tensor& moments, const std::vector<double>& counts, double eps);

namespace {
// The kernels record nothing for autograd.
bool kernels_apply(const at::Tensor& x) {
  return x.is_cuda() && fused_group_norm_enabled() && !(at::GradMode::is_enabled() && x.requires_grad());
}
}  // namespace
#endif

PatchContext::~PatchContext() = default;

PatchContext* patch_context() { return t_context; }

PatchContext* patch_context_for_convolutions() {
  return t_context && !t_context->convolves_locally() ? t_context : nullptr;
}

PatchScope::PatchScope(PatchContext* context) : previous_(t_context) { t_context = context; }
PatchScope::~PatchScope() { t_context = previous_; }

at::Tensor conv_halo(const at::Tensor& x, std::int64_t p) {
  const auto h = x.size(2);
  if (h < p)
    throw Error("patch parallelism: a band of " + std::to_string(h) + " row(s) is thinner than the convolution's " +
                std::to_string(p) + "-row halo");
  return at::cat({x.narrow(2, 0, p), x.narrow(2, h - p, p)}, 2).contiguous();
}

at::Tensor band_conv2d(const Conv2dImpl& conv, const at::Tensor& x, const std::vector<at::Tensor>& halos, int rank) {
  const auto& o = conv.options;
  const std::int64_t p = o.padding_;
  if (o.kernel != 2 * p + 1 || (o.stride_ != 1 && o.stride_ != 2))
    throw Error("patch parallelism: a convolution with kernel " + std::to_string(o.kernel) + ", padding " +
                std::to_string(p) + ", stride " + std::to_string(o.stride_) +
                " (only 'same' padding, kernel 2p + 1, at stride 1 or 2)");
  if (o.stride_ == 2 && x.size(2) % 2 != 0)
    throw Error("patch parallelism: a stride-2 convolution on a band of " + std::to_string(x.size(2)) +
                " rows (needs an even band height)");
  const int n = static_cast<int>(halos.size());
  const auto zeros = [&] {
    auto s = x.sizes().vec();
    s[2] = p;
    return at::zeros(s, x.options().memory_format(x.suggest_memory_format()));
  };
  // A neighbour's halo holds its first p rows then its last p rows.
  const auto above = rank > 0 ? halos[static_cast<std::size_t>(rank) - 1].narrow(2, p, p).to(x.device(), x.scalar_type())
                              : zeros();
  const auto below = rank + 1 < n ? halos[static_cast<std::size_t>(rank) + 1].narrow(2, 0, p).to(x.device(), x.scalar_type())
                                  : zeros();
  const auto padded = at::cat({above, x, below}, 2);
  const std::vector<std::int64_t> stride = {o.stride_, o.stride_}, padding = {0, p};
  return at::conv2d(padded, conv.weight, conv.bias, stride, padding);
}

at::Tensor add_per_channel(const at::Tensor& x, const at::Tensor& add) {
  if (!add.defined()) return x;
  std::vector<std::int64_t> shape(static_cast<std::size_t>(x.dim()), 1);
  shape[0] = add.size(0);
  shape[1] = add.size(1);
  return x + add.view(shape);
}

at::Tensor group_stats(const at::Tensor& x, std::int64_t groups) {
  const auto grouped = x.to(at::kFloat).reshape({x.size(0), groups, -1});
  const auto [var, mean] = at::var_mean(grouped, /*dim=*/{2}, /*correction=*/0, /*keepdim=*/false);
  return at::stack({mean, var}).contiguous();
}

at::Tensor band_group_norm(const GroupNormImpl& norm, const at::Tensor& x, const std::vector<at::Tensor>& stats,
                           bool silu) {
  const auto all = at::stack(at::TensorList(stats)).to(x.device());  // [n, 2, B, G]
  const auto means = all.select(1, 0), vars = all.select(1, 1);
  const auto mean = means.mean(0);
  const auto var = (vars + (means - mean).pow(2)).mean(0);
  return group_norm_with_stats(norm, x, {}, at::stack({mean, at::rsqrt(var + norm.options.eps_)}, -1), silu);
}

at::Tensor group_moments(const at::Tensor& x, const at::Tensor& add, std::int64_t groups, std::int64_t row_begin,
                         std::int64_t row_end) {
  if (x.dim() != 4 || row_begin < 0 || row_end <= row_begin || row_end > x.size(2))
    throw Error("GroupNorm moments: rows [" + std::to_string(row_begin) + ", " + std::to_string(row_end) + ") of input " +
                c10::str(x.sizes()) + " (wants [B, C, H, W] and 0 <= begin < end <= H)");
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  at::Tensor m;
  if (kernels_apply(x) && group_norm_moments_cuda(x, add, groups, row_begin, row_end, m)) return m;
#endif
  const auto rows = add_per_channel(x.narrow(2, row_begin, row_end - row_begin), add);
  const auto grouped = rows.to(at::kFloat).reshape({x.size(0), groups, -1});
  const auto [var, mean] = at::var_mean(grouped, /*dim=*/{2}, /*correction=*/0, /*keepdim=*/false);
  return at::stack({mean, var}, -1).contiguous();
}

at::Tensor combine_group_moments(const at::Tensor& moments, const std::vector<double>& counts, double eps) {
  if (moments.dim() < 2 || moments.size(0) != static_cast<std::int64_t>(counts.size()) || moments.size(-1) != 2)
    throw Error("GroupNorm moments: " + c10::str(moments.sizes()) + " for " + std::to_string(counts.size()) +
                " parts (wants [parts, ..., 2])");
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  if (moments.is_cuda() && fused_group_norm_enabled()) return group_norm_combine_cuda(moments, counts, eps);
#endif
  const auto m = moments.to(at::kDouble);
  std::vector<std::int64_t> shape(static_cast<std::size_t>(m.dim() - 1), 1);
  shape[0] = m.size(0);
  const auto w = at::tensor(counts, m.options()).view(shape);
  const auto total = w.sum();
  const auto means = m.select(-1, 0), vars = m.select(-1, 1);
  const auto mean = (w * means).sum(0) / total;
  const auto var = (w * (vars + (means - mean).square())).sum(0) / total;
  return at::stack({mean, at::rsqrt(var + eps)}, -1).to(at::kFloat).contiguous();
}

at::Tensor group_norm_with_stats(const GroupNormImpl& norm, const at::Tensor& x, const at::Tensor& add,
                                 const at::Tensor& stats, bool silu) {
  const auto groups = norm.options.groups;
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  at::Tensor out;
  if (kernels_apply(x) && group_norm_apply_cuda(x, add, norm.weight, norm.bias, stats, groups, silu, out)) return out;
#endif
  const auto in = add_per_channel(x, add);
  const auto st = stats.to(in.device(), at::kFloat);
  const auto mean = st.select(-1, 0), rstd = st.select(-1, 1);  // [B, G]
  // Per (batch, channel) scale and shift in fp32, as at::group_norm's kernels fold them:
  // y = x * rstd w + (b - mean rstd w). One pass over x in its own type (fp32 arithmetic per
  // element, no fp32 copy of the activation), the SiLU in place.
  const auto channels = in.size(1);
  const auto per_channel = [&](const at::Tensor& g) { return g.repeat_interleave(channels / groups, 1); };  // [B, C]
  const auto scale = per_channel(rstd) * norm.weight.to(at::kFloat).view({1, channels});
  const auto shift = norm.bias.to(at::kFloat).view({1, channels}) - per_channel(mean) * scale;
  std::vector<std::int64_t> bc(static_cast<std::size_t>(in.dim()), 1);
  bc[0] = in.size(0);
  bc[1] = channels;
  at::Tensor y;
  if (at::GradMode::is_enabled() && (in.requires_grad() || scale.requires_grad() || shift.requires_grad())) {
    y = at::addcmul(shift.view(bc), in, scale.view(bc)).to(in.scalar_type());  // out= does not differentiate
  } else {
    y = at::empty_like(in, in.options(), in.suggest_memory_format());
    at::addcmul_out(y, shift.view(bc), in, scale.view(bc));
  }
  if (silu) y = y.requires_grad() ? at::silu(y) : at::silu_(y);
  return y.contiguous(in.suggest_memory_format());
}

at::Tensor kv_pack(const at::Tensor& k, const at::Tensor& v) { return at::cat({k, v}, -1).contiguous(); }

std::pair<at::Tensor, at::Tensor> kv_unpack(const std::vector<at::Tensor>& packs) {
  const auto device = packs.front().device();
  std::vector<at::Tensor> on;
  on.reserve(packs.size());
  for (const auto& p : packs) on.push_back(p.to(device));
  const auto all = at::cat(on, 1);
  const auto c = all.size(2) / 2;
  return {all.narrow(2, 0, c), all.narrow(2, c, c)};
}

at::Tensor BandContext::conv2d(Conv2dImpl& conv, const at::Tensor& x) {
  return band_conv2d(conv, x, exchange(conv_halo(x, conv.options.padding_)), rank_);
}

at::Tensor BandContext::group_norm(GroupNormImpl& norm, const at::Tensor& x, const at::Tensor& add, bool silu) {
  const auto in = add_per_channel(x, add);
  return band_group_norm(norm, in, exchange(group_stats(in, norm.options.groups)), silu);
}

std::pair<at::Tensor, at::Tensor> BandContext::self_attention_kv(const at::Tensor& k, const at::Tensor& v) {
  auto packs = exchange(kv_pack(k, v));
  auto out = kv_unpack(packs);
  return {out.first.to(k.device()), out.second.to(k.device())};
}

}  // namespace diffract::models
