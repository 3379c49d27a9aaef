#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <memory>

#include "core/models/common/fused_linears.h"
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

// Every ResNet block's time-embedding projection below a model (SDXL's UNet: 17 GEMMs of the
// same silu(temb) per step, each of 1 or 2 rows) as one GEMM. fuse() lays the time_emb_proj
// weights end to end (FusedLinears); a forward that owns a TimeProjections opens a
// TimeProjectionScope with its time embedding, and the blocks under it that are handed that same
// tensor take their slice of the scope's product. Inference only, while the layout is intact.
class TimeProjections : public FusedLinearsGroup {
 public:
  // Null where `root` has no ResNet block with a time embedding.
  static std::shared_ptr<TimeProjections> fuse(torch::nn::Module& root);
};

class TimeProjectionScope : FusedLinearsScope<TimeProjections> {
 public:
  // temb [B, Ct]. Projects silu(temb) for every member when `group` is non-null and intact, temb
  // is defined and autograd is not recording; otherwise a scope that gives none.
  TimeProjectionScope(const TimeProjections* group, const at::Tensor& temb);
  // The innermost scope's projection [B, Cout] (a view of a wider tensor) for `block` given
  // `temb`, or undefined when there is none (no scope, not a member, another temb tensor).
  static at::Tensor lookup(const ResnetBlock2DImpl* block, const at::Tensor& temb) {
    return FusedLinearsScope::lookup(block, temb, 0);
  }
};
bool fused_time_projections_wanted();  // unless DIFFRACT_FUSED_TIME_PROJ=0

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
