#pragma once
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "core/models/common/attention.h"
#include "core/models/common/layers.h"
#include "core/models/common/resnet.h"

namespace diffract::models {

// diffusers' AutoencoderKL config, as its config.json spells it.
struct AutoencoderKLConfig {
  int64_t in_channels = 3;
  int64_t out_channels = 3;
  std::vector<std::string> down_block_types = std::vector<std::string>(4, "DownEncoderBlock2D");
  std::vector<std::string> up_block_types = std::vector<std::string>(4, "UpDecoderBlock2D");
  std::vector<int64_t> block_out_channels{128, 256, 512, 512};
  int64_t layers_per_block = 2;
  int64_t latent_channels = 4;
  int64_t norm_num_groups = 32;
  int64_t sample_size = 512;               // the first entry when config.json gives a list
  double scaling_factor = 0.18215;
  std::optional<double> shift_factor;      // null in SD / SDXL configs: no shift
  bool force_upcast = true;                // fp16 overflows: encode / decode run in fp32 (see AutoencoderKLImpl)
  bool use_quant_conv = true;
  bool use_post_quant_conv = true;
  bool mid_block_add_attention = true;

  // Images are this many times larger than latents: 2^(number of blocks - 1).
  int64_t downscale_factor() const;

  static AutoencoderKLConfig sd();    // SD 1.x / 2.x
  static AutoencoderKLConfig sdxl();  // SDXL: scaling 0.13025
  static AutoencoderKLConfig sd3();   // SD3: 16 channels, shift 0.0609, scaling 1.5305, no quant convs
  static AutoencoderKLConfig flux();  // FLUX.1: 16 channels, shift 0.1159, scaling 0.3611, no quant convs
  // Architecture keys (block_out_channels, down_block_types, up_block_types, layers_per_block,
  // latent_channels) are required; the rest default as diffusers' AutoencoderKL does (scaling
  // 0.18215, shift null, force_upcast and both quant convs on, ...). Only DownEncoderBlock2D /
  // UpDecoderBlock2D and act_fn "silu" exist in AutoencoderKL VAEs; anything else is an error.
  // Errors name the file and the key.
  static AutoencoderKLConfig from_json(const std::filesystem::path& config_json);
};

// diffusers' DiagonalGaussianDistribution: the encoder's posterior over UNSCALED latents.
struct LatentDistribution {
  at::Tensor mean;    // [B, C, h, w]
  at::Tensor logvar;  // [B, C, h, w], clamped to [-30, 20]

  at::Tensor std() const;   // exp(logvar / 2)
  at::Tensor mode() const { return mean; }
  // mean + std * eps, eps drawn as diffusers' randn_tensor does: randn of mean's shape and
  // dtype on the generator's device (the default generator of mean's device when undefined),
  // then moved to mean's device. A seeded CPU generator gives diffusers' sample bit for bit.
  at::Tensor sample(std::optional<at::Generator> generator = std::nullopt) const;
};

// DownEncoderBlock2D: resnets.N (ResnetBlock2D, no time embedding), downsamplers.0 (stride-2
// conv, padding 0 after a (0, 1, 0, 1) pad) except on the last block.
class DownEncoderBlock2DImpl : public torch::nn::Module {
 public:
  DownEncoderBlock2DImpl(int64_t in_channels, int64_t out_channels, int64_t layers, int64_t groups, bool downsample);
  at::Tensor forward(const at::Tensor& x);  // [B, Cin, H, W] -> [B, Cout, H/2, W/2] (H, W without downsampler)
  torch::nn::ModuleList resnets{nullptr}, downsamplers{nullptr};
};
TORCH_MODULE(DownEncoderBlock2D);

// UpDecoderBlock2D: resnets.N, upsamplers.0 (nearest 2x then a 3x3 conv) except on the last block.
class UpDecoderBlock2DImpl : public torch::nn::Module {
 public:
  UpDecoderBlock2DImpl(int64_t in_channels, int64_t out_channels, int64_t layers, int64_t groups, bool upsample);
  at::Tensor forward(const at::Tensor& x);  // [B, Cin, H, W] -> [B, Cout, 2H, 2W] (H, W without upsampler)
  torch::nn::ModuleList resnets{nullptr}, upsamplers{nullptr};
};
TORCH_MODULE(UpDecoderBlock2D);

// The VAE's UNetMidBlock2D: resnets.0, attentions.0 (single-head self-attention over the pixels,
// GroupNorm first, residual; absent when mid_block_add_attention is false), resnets.1.
class VAEMidBlock2DImpl : public torch::nn::Module {
 public:
  VAEMidBlock2DImpl(int64_t channels, int64_t groups, bool add_attention);
  at::Tensor forward(const at::Tensor& x);  // [B, C, H, W] -> [B, C, H, W]
  torch::nn::ModuleList resnets{nullptr}, attentions{nullptr};
};
TORCH_MODULE(VAEMidBlock2D);

// diffusers' vae.Encoder: conv_in, down_blocks.N, mid_block, conv_norm_out, SiLU, conv_out
// (2 * latent_channels: mean and logvar).
class VAEEncoderImpl : public torch::nn::Module {
 public:
  explicit VAEEncoderImpl(const AutoencoderKLConfig& c);
  at::Tensor forward(const at::Tensor& images);  // [B, 3, H, W] -> [B, 2 * C, H / f, W / f]
  Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList down_blocks{nullptr};
  VAEMidBlock2D mid_block{nullptr};
  GroupNorm conv_norm_out{nullptr};
};
TORCH_MODULE(VAEEncoder);

// diffusers' vae.Decoder: conv_in, mid_block, up_blocks.N (layers_per_block + 1 resnets each,
// channels reversed), conv_norm_out, SiLU, conv_out.
class VAEDecoderImpl : public torch::nn::Module {
 public:
  explicit VAEDecoderImpl(const AutoencoderKLConfig& c);
  at::Tensor forward(const at::Tensor& z);  // [B, C, h, w] -> [B, 3, h * f, w * f]
  Conv2d conv_in{nullptr}, conv_out{nullptr};
  VAEMidBlock2D mid_block{nullptr};
  torch::nn::ModuleList up_blocks{nullptr};
  GroupNorm conv_norm_out{nullptr};
};
TORCH_MODULE(VAEDecoder);

// Decodes z [B, C, h, w] in overlapping tiles of `tile` latents a side with `decode` (latents
// -> images `factor` times larger) and cross-fades the `overlap` each tile shares with a
// neighbour, so nothing shows where tiles meet even when each tile's decode differs a little
// (per-tile normalisation statistics). Returns float32 images.
at::Tensor decode_in_tiles(const at::Tensor& z, int64_t tile, int64_t overlap, int64_t factor,
                           const std::function<at::Tensor(const at::Tensor&)>& decode);

// diffusers' AutoencoderKL: encoder, decoder, quant_conv / post_quant_conv (1x1, when the
// config uses them).
//
// Precision: the module runs in its parameters' dtype (inputs are converted to it and to its
// device). When those are fp16 and config.force_upcast is set (the SD / SDXL / SD3 / FLUX VAEs
// overflow in fp16), encode and decode run instead on an fp32 copy of the part they need
// (encoder + quant_conv, or post_quant_conv + decoder), made from the fp16 parameters on first
// use and kept on the module's device, and return fp32; this is diffusers' upcast_vae without
// changing the module. fp16 -> fp32 is exact, so the copy computes what diffusers' upcast VAE
// does. bf16 (fp32's range) never upcasts. release_fp32_copies() frees the copies (and must
// be called after changing the fp16 weights). Like any module, not for concurrent calls.
class AutoencoderKLImpl : public torch::nn::Module {
 public:
  explicit AutoencoderKLImpl(const AutoencoderKLConfig& c);
  // images: [B, in_channels, H, W] in [-1, 1], H and W multiples of downscale_factor()
  // -> posterior over unscaled latents [B, latent_channels, H / f, W / f].
  LatentDistribution encode(const at::Tensor& images);
  // z: unscaled latents [B, latent_channels, h, w] -> images [B, out_channels, h * f, w * f] in
  // [-1, 1] (not clamped, as diffusers returns them).
  at::Tensor decode(const at::Tensor& z);
  // What decode() runs, for callers that run the decoder's parts themselves (a row-band decode,
  // core/parallel/parallel_vae.h): decoder and post_quant_conv (undefined without one) and the
  // dtype they take, the fp32 copies (made here on first use) when it upcasts.
  struct DecodeModules {
    VAEDecoder decoder{nullptr};
    Conv2d post_quant_conv{nullptr};
    at::ScalarType dtype = at::kFloat;
  };
  DecodeModules decode_modules();
  // decode() in overlapping tiles of `tile` latents a side, `overlap` of them shared with each
  // neighbour and cross-faded there, so a large image needs only a tile's activation memory.
  // GroupNorm statistics and attention are per tile, so the result differs slightly from
  // decode(); the cross-fade keeps that difference smooth (no seams). Latents within one tile
  // go straight to decode().
  at::Tensor decode_tiled(const at::Tensor& z, int64_t tile = 128, int64_t overlap = 32);
  // Unscaled VAE latents <-> the diffusion model's latent space: (z - shift) * scaling and back.
  at::Tensor scale_latents(const at::Tensor& z) const;
  at::Tensor unscale_latents(const at::Tensor& x) const;
  // True when encode / decode would take the fp32 path (fp16 parameters and force_upcast).
  bool upcasts() const;
  void release_fp32_copies();

  AutoencoderKLConfig config;
  VAEEncoder encoder{nullptr};
  VAEDecoder decoder{nullptr};
  Conv2d quant_conv{nullptr}, post_quant_conv{nullptr};

 private:
  // Not registered: invisible to parameters(), bind() and to().
  VAEEncoder encoder_fp32_{nullptr};
  VAEDecoder decoder_fp32_{nullptr};
  Conv2d quant_conv_fp32_{nullptr}, post_quant_conv_fp32_{nullptr};
};
TORCH_MODULE(AutoencoderKL);

// A diffusers VAE folder (config.json + diffusion_pytorch_model[.variant].safetensors), strictly
// bound into an fp32 module on the CPU (whatever the file's dtype); move / cast it afterwards.
AutoencoderKL load_autoencoder_kl(const std::filesystem::path& dir, const std::string& variant = "");

}  // namespace diffract::models
