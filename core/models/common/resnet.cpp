#include "core/models/common/resnet.h"

#include <cstdlib>
#include <string>

#include <ATen/ATen.h>

#include "core/models/common/cancel_point.h"
#include "core/models/common/patch_parallel.h"
#include "core/util/options.h"

namespace diffract::models {

namespace nn = torch::nn;

ResnetBlock2DImpl::ResnetBlock2DImpl(const ResnetBlock2DOptions& o) : options(o) {
  if (options.out_channels == 0) options.out_channels = o.in_channels;
  const auto in = o.in_channels, out = options.out_channels;
  norm1 = register_module("norm1", GroupNorm(GroupNormOptions(o.groups, in).eps(o.eps)));
  conv1 = register_module("conv1", Conv2d(Conv2dOptions(in, out, 3).padding(1)));
  if (o.temb_channels > 0) time_emb_proj = register_module("time_emb_proj", Linear(o.temb_channels, out));
  norm2 = register_module("norm2", GroupNorm(GroupNormOptions(o.groups, out).eps(o.eps)));
  conv2 = register_module("conv2", Conv2d(Conv2dOptions(out, out, 3).padding(1)));
  if (in != out) conv_shortcut = register_module("conv_shortcut", Conv2d(Conv2dOptions(in, out, 1)));
}

at::Tensor ResnetBlock2DImpl::forward(const at::Tensor& x, const at::Tensor& temb) {
  cancel_point();
  // x [B, in, h, w], temb [B, temb_channels] or undefined -> [B, out, h, w]
  // The time embedding is added per channel inside norm2's kernels, not as a broadcast add; on
  // CUDA so is conv1's bias, and conv2 adds its bias, the skip connection and the shortcut's
  // bias in one kernel.
  at::Tensor t;
  if (time_emb_proj && temb.defined()) {
    t = TimeProjectionScope::lookup(this, temb);
    if (!t.defined()) t = time_emb_proj->forward(at::silu(temb));
  }
  at::Tensor out;
  if (x.is_cuda() && conv_bias_kernel_available() && conv1->bias.defined() && !patch_context_for_convolutions()) {
    // The shortcut's bias goes in with conv2's bias and the skip, in conv2's kernel.
    const bool fold_shortcut = conv_shortcut && conv_shortcut->bias.defined();
    const auto skip = !conv_shortcut ? x : fold_shortcut ? conv_shortcut->forward_without_bias(x) : conv_shortcut->forward(x);
    auto h = conv1->forward_without_bias(norm1->forward(x, {}, /*silu=*/true));
    h = norm2->forward(h, t, /*silu=*/true, /*channel_add=*/conv1->bias);
    out = conv2->forward_add(h, skip, fold_shortcut ? conv_shortcut->bias : at::Tensor());
  } else {
    const auto skip = conv_shortcut ? conv_shortcut->forward(x) : x;
    const auto h = norm2->forward(conv1->forward(norm1->forward(x, {}, /*silu=*/true)), t, /*silu=*/true);
    out = conv2->forward_add(h, skip);
  }
  return options.output_scale_factor == 1.0 ? out : out / options.output_scale_factor;
}

std::shared_ptr<TimeProjections> TimeProjections::fuse(torch::nn::Module& root) {
  return holding<TimeProjections>(
      FusedLinears::fuse_below(root, [](torch::nn::Module& m) -> std::optional<FusedLinears::Member> {
        auto* r = dynamic_cast<ResnetBlock2DImpl*>(&m);
        if (!r || !r->time_emb_proj) return std::nullopt;
        return FusedLinears::Member{r, {r->time_emb_proj.get()}};
      }));
}

TimeProjectionScope::TimeProjectionScope(const TimeProjections* group, const at::Tensor& temb)
    : FusedLinearsScope(group ? group->linears() : nullptr, temb,
                        [](const at::Tensor& t) { return at::silu(t); }) {}

bool fused_time_projections_wanted() {
  return options::flag(options::Id::FusedTimeProj);
}

Downsample2DImpl::Downsample2DImpl(int64_t channels, int64_t out_channels, int64_t pad) : padding(pad) {
  conv = register_module("conv", Conv2d(Conv2dOptions(channels, out_channels, 3).stride(2).padding(pad)));
}

at::Tensor Downsample2DImpl::forward(const at::Tensor& x) {
  if (padding == 0) return conv->forward(at::constant_pad_nd(x, {0, 1, 0, 1}, 0));
  return conv->forward(x);
}

Upsample2DImpl::Upsample2DImpl(int64_t channels, int64_t out_channels) {
  conv = register_module("conv", Conv2d(Conv2dOptions(channels, out_channels, 3).padding(1)));
}

at::Tensor Upsample2DImpl::forward(const at::Tensor& x, at::IntArrayRef size) {
  at::Tensor up = size.empty() ? at::upsample_nearest2d(x, {x.size(2) * 2, x.size(3) * 2})
                               : at::upsample_nearest2d(x, size);
  return conv->forward(up);
}

}  // namespace diffract::models
