#pragma once
// diffusers' ControlNetModel (SD 1.x / 2.x / XL): a copy of the UNet's encoder (conv_in, time and
// added embeddings, down blocks, mid block) whose input adds the control image's embedding, and a
// zero-initialised 1x1 convolution per skip connection and for the mid block. Its outputs are
// added to the UNet's skips and mid-block output (UNetConditioning::down_residuals / mid_residual).
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/models/common/embeddings.h"
#include "core/models/common/layers.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/util/graphed_function.h"

namespace diffract::models {

struct ControlNetConfig {
  UNet2DConditionConfig unet;  // the encoder's shape (its up-block fields unused)
  int64_t conditioning_channels = 3;
  std::vector<int64_t> conditioning_embedding_out_channels = {16, 32, 96, 256};
  bool global_pool_conditions = false;  // "shuffle"-style ControlNets: residuals averaged over the image
  // diffusers' config.json of a ControlNetModel; unsupported options are errors naming the file and key.
  static ControlNetConfig from_json(const std::filesystem::path& config_json);
};

// The control image [B, 3, H, W] in [0, 1] -> [B, C0, H / 8, W / 8]: conv_in, then pairs of 3x3
// convolutions (the second of each with stride 2), SiLU after each, and the zero conv_out.
class ControlNetConditioningEmbeddingImpl : public torch::nn::Module {
 public:
  ControlNetConditioningEmbeddingImpl(int64_t embedding_channels, int64_t conditioning_channels,
                                      const std::vector<int64_t>& block_out_channels);
  at::Tensor forward(const at::Tensor& cond);
  Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(ControlNetConditioningEmbedding);

struct ControlNetOutput {
  std::vector<at::Tensor> down;  // one per UNet skip connection, in production order
  at::Tensor mid;
};

class ControlNetModelImpl : public torch::nn::Module {
 public:
  explicit ControlNetModelImpl(const ControlNetConfig& config);
  // sample [B, C, h, w] (the UNet's input), timesteps [B], the UNet's conditioning (text, SDXL's
  // added embeddings), the control image [B, 3, 8h, 8w] in [0, 1]: the residuals times `scale`.
  ControlNetOutput forward(const at::Tensor& sample, const at::Tensor& timesteps, const UNetConditioning& cond,
                           const at::Tensor& control_image, double scale);

  ControlNetConfig config;
  Conv2d conv_in{nullptr};
  TimestepEmbedding time_embedding{nullptr}, add_embedding{nullptr};
  ControlNetConditioningEmbedding controlnet_cond_embedding{nullptr};
  torch::nn::ModuleList down_blocks{nullptr}, controlnet_down_blocks{nullptr};
  MidBlock mid_block{nullptr};
  Conv2d controlnet_mid_block{nullptr};
};
TORCH_MODULE(ControlNetModel);

// A ControlNet as a job runs it: the control image for the rows the denoiser evaluates, and the
// part of the schedule it acts on.
struct ControlNetUnit {
  ControlNetModel net{nullptr};
  at::Tensor image;  // [rows, 3, H, W] in [0, 1], the model's device and dtype
  double scale = 1.0, start = 0.0, end = 1.0;
  // When set, the net's forward replays from CUDA graphs there (one caller thread at a time),
  // its 4-D inputs in `layout`.
  std::shared_ptr<GraphCache> graphs;
  std::optional<at::MemoryFormat> layout;
  // diffusers' controlnet_keep: step i of n acts unless i / n < start or (i + 1) / n > end.
  bool acts(int step, int steps) const;
  ControlNetUnit rows(int64_t begin, int64_t count) const;  // the image's rows [begin, begin + count)
};

// `cond` with the summed residuals of the units acting at step `step` of `steps` for the UNet
// input x [rows, C, h, w] at timesteps t (the units' images having those rows); `cond` itself
// when none acts.
UNetConditioning add_controlnet_residuals(const UNetConditioning& cond, const std::vector<ControlNetUnit>& units,
                                          const at::Tensor& x, const at::Tensor& t, int step, int steps);

// A diffusers ControlNetModel folder (config.json + diffusion_pytorch_model[.variant].safetensors).
ControlNetModel load_controlnet(const std::filesystem::path& dir, const std::string& variant = "");

}  // namespace diffract::models
