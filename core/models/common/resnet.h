#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "core/models/common/layers.h"

namespace diffract::models {

// diffusers' ResnetBlock2D ("default" time-embedding norm, SiLU): keys norm1, conv1,
// time_emb_proj, norm2, conv2, conv_shortcut (1x1, when the channel count changes).
struct ResnetBlock2DOptions {
  int64_t in_channels = 0;
  int64_t out_channels = 0;      // 0: same as in
  int64_t temb_channels = 0;     // 0: no time embedding (VAE)
  int64_t groups = 32;
  double eps = 1e-6;
  double output_scale_factor = 1.0;
};

class ResnetBlock2DImpl : public torch::nn::Module {
 public:
  explicit ResnetBlock2DImpl(const ResnetBlock2DOptions& o);
  // x: [B, Cin, H, W], temb: [B, Ct] or undefined -> [B, Cout, H, W].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& temb = {});
  ResnetBlock2DOptions options;
  GroupNorm norm1{nullptr}, norm2{nullptr};
  Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};
  Linear time_emb_proj{nullptr};
};
TORCH_MODULE(ResnetBlock2D);

// Stride-2 3x3 conv ("conv"). With padding 0 the input is padded (0, 1, 0, 1) first, as
// the VAE encoder does.
class Downsample2DImpl : public torch::nn::Module {
 public:
  Downsample2DImpl(int64_t channels, int64_t out_channels, int64_t padding);
  at::Tensor forward(const at::Tensor& x);  // [B, C, H, W] -> [B, Cout, H/2, W/2]
  int64_t padding;
  Conv2d conv{nullptr};
};
TORCH_MODULE(Downsample2D);

// Nearest-neighbour 2x (or to `size`) then a 3x3 conv ("conv").
class Upsample2DImpl : public torch::nn::Module {
 public:
  Upsample2DImpl(int64_t channels, int64_t out_channels);
  at::Tensor forward(const at::Tensor& x, at::IntArrayRef size = {});  // [B, C, H, W] -> [B, Cout, 2H, 2W]
  Conv2d conv{nullptr};
};
TORCH_MODULE(Upsample2D);

}  // namespace diffract::models
