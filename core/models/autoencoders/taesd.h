#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include "core/models/common/layers.h"

namespace diffract::models {

// The Tiny AutoEncoder (madebyollin/taesd; diffusers' AutoencoderTiny), whose config.json
// spells these keys, plus `midblock_group_norm`, which no diffusers config has: the FLUX.2
// variant's extra GroupNorm branch in the blocks of the encoder's last stage and the decoder's
// first stage (found from the weights' key names).
struct TAESDConfig {
  // "taesd", "taesdxl", "taesd3", "taef1", "taef2", or "" for a diffusers config of no known
  // variant. taesd / taesdxl (4 latent channels) and taesd3 / taef1 (16) have identical shapes:
  // file or folder names pick between them, else the first is named.
  std::string variant = "taesd";
  int64_t in_channels = 3;
  int64_t out_channels = 3;
  int64_t latent_channels = 4;
  std::vector<int64_t> encoder_block_out_channels{64, 64, 64, 64};
  std::vector<int64_t> decoder_block_out_channels{64, 64, 64, 64};
  std::vector<int64_t> num_encoder_blocks{1, 3, 3, 3};
  std::vector<int64_t> num_decoder_blocks{3, 3, 3, 1};
  int64_t upsampling_scaling_factor = 2;
  bool midblock_group_norm = false;
  // Only for storing latents as 8-bit images (diffusers' scale_latents); encode / decode ignore them.
  double latent_magnitude = 3.0;
  double latent_shift = 0.5;
  // Every published TAESD works in the diffusion model's latent space directly (1.0 and 0.0);
  // kept for pipelines that read them, never applied by encode / decode (as in diffusers).
  double scaling_factor = 1.0;
  double shift_factor = 0.0;

  // Images are this many times larger than latents: 2^(encoder stages - 1), 8 for every variant.
  int64_t downscale_factor() const;

  static TAESDConfig taesd();    // SD 1.x / 2.x, 4 channels
  static TAESDConfig taesdxl();  // SDXL, 4 channels
  static TAESDConfig taesd3();   // SD3, 16 channels
  static TAESDConfig taef1();    // FLUX.1, 16 channels
  static TAESDConfig taef2();    // FLUX.2, 32 channels, mid-block GroupNorm
  // latent_channels and the four block lists are required; the rest default as diffusers'
  // AutoencoderTiny does. act_fn must be relu and upsample_fn nearest. Errors name file and key.
  static TAESDConfig from_json(const std::filesystem::path& config_json);
};

// AutoencoderTinyBlock: conv.0 / conv.2 / conv.4 (3x3, ReLU between), skip (1x1, no bias, only
// when the channel count changes), ReLU after the sum. With the mid-block GroupNorm it first
// adds pool(x): pool.0 (1x1 C -> 4C, no bias), pool.1 (GroupNorm, 4 groups), ReLU, pool.3
// (1x1 4C -> C, no bias).
class TAESDBlockImpl : public torch::nn::Module {
 public:
  TAESDBlockImpl(int64_t in_channels, int64_t out_channels, bool group_norm);
  at::Tensor forward(const at::Tensor& x);  // [B, Cin, H, W] -> [B, Cout, H, W]
  // The same through cuDNN's fused convolutions (CUDA only; see set_fused_taesd): conv.0 and
  // conv.2 as relu(conv + bias), conv.4 as relu(conv + bias + h); pool as in forward. A block
  // with a skip conv runs forward.
  at::Tensor forward_fused(const at::Tensor& x);
  torch::nn::Sequential conv{nullptr}, pool{nullptr};
  Conv2d skip{nullptr};
};
TORCH_MODULE(TAESDBlock);

// EncoderTiny: layers.N, per stage a conv (the first 3x3 from the image, the others stride 2
// without bias) and its blocks, then a 3x3 conv to the latent channels.
class TAESDEncoderImpl : public torch::nn::Module {
 public:
  explicit TAESDEncoderImpl(const TAESDConfig& c);
  at::Tensor forward(const at::Tensor& x);  // images in [0, 1] [B, 3, H, W] -> latents [B, C, H/8, W/8]
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(TAESDEncoder);

// DecoderTiny: layers.N, a 3x3 conv from the latents and ReLU, per stage its blocks, then a
// nearest 2x upsample and a 3x3 conv without bias (the last stage: a 3x3 conv to RGB, with bias).
class TAESDDecoderImpl : public torch::nn::Module {
 public:
  explicit TAESDDecoderImpl(const TAESDConfig& c);
  // latents [B, C, h, w] -> images in [0, 1] (roughly) [B, 3, 8h, 8w]; the blocks fused when
  // fused_applies(z).
  at::Tensor forward(const at::Tensor& z);
  // Whether forward(z) takes the fused path: set_fused_taesd on, z on CUDA in fp16 or bf16 as
  // the weights are, cuDNN present and enabled, grad mode off, no patch context.
  bool fused_applies(const at::Tensor& z);
  torch::nn::Sequential layers{nullptr};

 private:
  at::Tensor forward_fused(const at::Tensor& z);
};
TORCH_MODULE(TAESDDecoder);

// AutoencoderTiny with diffusers' conventions: images in [-1, 1], latents in the diffusion
// model's latent space. Either part may be absent (a decoder alone is enough for previews).
class TAESDImpl : public torch::nn::Module {
 public:
  TAESDImpl(const TAESDConfig& c, bool with_encoder = true, bool with_decoder = true);
  // images: [B, in_channels, H, W] in [-1, 1], H and W multiples of 8 -> latents
  // [B, latent_channels, H / 8, W / 8], what diffusers' AutoencoderTiny.encode(x).latents gives.
  at::Tensor encode(const at::Tensor& images);
  // latents: [B, latent_channels, h, w] -> images [B, out_channels, 8h, 8w] in [-1, 1] (not
  // clamped), what diffusers' AutoencoderTiny.decode(z).sample gives. The latents are soft-
  // clamped first (tanh(z / 3) * 3).
  at::Tensor decode(const at::Tensor& latents);
  bool has_encoder() const { return !encoder.is_empty(); }
  bool has_decoder() const { return !decoder.is_empty(); }

  TAESDConfig config;
  std::string source;  // where the weights came from, for messages
  TAESDEncoder encoder{nullptr};
  TAESDDecoder decoder{nullptr};
};
TORCH_MODULE(TAESD);

// The decoder's blocks as cuDNN's fused convolutions (at::cudnn_convolution_relu and
// at::cudnn_convolution_add_relu), one kernel per convolution where eager conv2d runs the
// convolution, then the bias, the ReLU and the residual add as separate passes over 64-channel
// images. cuDNN's graph keeps the sum in fp32 and rounds once, where eager rounds after each
// op. On unless DIFFRACT_FUSED_TAESD=0 at start; set_fused_taesd switches at any time. If
// cuDNN has no engine for the fused graphs, the first such decode logs a warning, turns the
// switch off for the process and runs eagerly.
void set_fused_taesd(bool on);
bool fused_taesd_enabled();

// Loads a TAESD, strictly bound into an fp32 module on the CPU, from
//  - a diffusers AutoencoderTiny folder (config.json + diffusion_pytorch_model.safetensors);
//  - a folder holding madebyollin/taesd's files, `<name>_encoder.pth` and / or
//    `<name>_decoder.pth` (or .safetensors) for exactly one <name> (taesd, taesdxl, taesd3,
//    taef1, taef2, ...);
//  - one such file (an encoder-less TAESD from a decoder file, and the reverse), or one
//    safetensors file in diffusers' layout.
// The original files' variant (latent channels, mid-block GroupNorm) comes from the tensors'
// shapes and key names; shapes of no known variant are an error naming the file.
TAESD load_taesd(const std::filesystem::path& path);

}  // namespace diffract::models
