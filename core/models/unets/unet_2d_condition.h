#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "core/models/common/attention.h"
#include "core/models/common/embeddings.h"
#include "core/models/common/layer_norm.h"
#include "core/models/common/layers.h"
#include "core/models/common/resnet.h"

namespace diffract::io {
class JsonFile;
}

namespace diffract::models {

// diffusers' UNet2DConditionModel config, with per-block lists resolved (a scalar in
// config.json is repeated for every block), as SD 1.5, SD 2.x and SDXL use it.
struct UNet2DConditionConfig {
  int64_t in_channels = 4;
  int64_t out_channels = 4;
  int64_t sample_size = 64;
  bool flip_sin_to_cos = true;
  double freq_shift = 0;
  std::vector<std::string> down_block_types;
  std::vector<std::string> up_block_types;
  std::vector<int64_t> block_out_channels;
  std::vector<int64_t> layers_per_block;               // per down block
  std::vector<int64_t> cross_attention_dim;            // per down block
  std::vector<int64_t> transformer_layers_per_block;   // per down block
  std::vector<int64_t> reverse_transformer_layers_per_block;  // per up block
  std::vector<int64_t> num_attention_heads;            // per down block
  int64_t downsample_padding = 1;
  double mid_block_scale_factor = 1.0;
  int64_t norm_num_groups = 32;
  double norm_eps = 1e-5;
  bool use_linear_projection = false;
  std::string addition_embed_type;                     // "" or "text_time" (SDXL)
  int64_t addition_time_embed_dim = 256;
  int64_t projection_class_embeddings_input_dim = 0;

  int64_t time_embed_dim() const { return block_out_channels.front() * 4; }

  // Every count positive and within what a UNet of these families can have, the per-block lists
  // as long as the blocks, channels divisible by the groups and heads, the model within this
  // machine's memory: an Error naming `where` otherwise. The constructor calls it, so no module
  // is built from a config that fails.
  void validate(const std::string& where) const;
  // About how many parameters the model has (from the shapes; within a few per cent).
  int64_t parameter_count() const;

  static UNet2DConditionConfig sd15();
  static UNet2DConditionConfig sd21();        // v-prediction 768, linear projections, OpenCLIP-H context
  static UNet2DConditionConfig sdxl_base();
  // diffusers' config.json; unsupported options are errors naming the file and key.
  static UNet2DConditionConfig from_json(const std::filesystem::path& config_json);
  static UNet2DConditionConfig from_json(const io::JsonFile& config);
};

// Extra conditioning next to the text context: SDXL's pooled text embedding and
// [orig_h, orig_w, crop_top, crop_left, target_h, target_w] time ids.
struct UNetConditioning {
  at::Tensor encoder_hidden_states;  // [B, S, C]
  at::Tensor text_embeds;            // [B, P]  (text_time only)
  at::Tensor time_ids;               // [B, 6]  (text_time only)
  // ControlNets' additions (diffusers' down_block_additional_residuals and
  // mid_block_additional_residual): one per skip connection in production order, one for the mid
  // block's output. forward() only; empty: none.
  std::vector<at::Tensor> down_residuals;
  at::Tensor mid_residual;
};

// The time embedding of a UNet or of its ControlNet: the timesteps' sinusoidal embedding through
// `time`, plus SDXL's added embedding (pooled text and time ids through `add`) when `add` is given.
at::Tensor time_embedding_of(const UNet2DConditionConfig& c, TimestepEmbeddingImpl& time, TimestepEmbeddingImpl* add,
                             const at::Tensor& timesteps, const UNetConditioning& cond, c10::ScalarType dtype);

class BasicTransformerBlockImpl : public torch::nn::Module {
 public:
  BasicTransformerBlockImpl(int64_t dim, int64_t heads, int64_t dim_head, int64_t cross_attention_dim);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context);  // [B, T, C] -> [B, T, C]
  // x [B, T, C] and `pending` (undefined, or [B, T, C] still to be added to x) -> {h, f}, the
  // block's output being h + f: its feed-forward branch f is left for the caller to add (in the
  // next block's norm1 kernel). Each residual add runs inside the LayerNorm that reads the sum
  // (add_layer_norm), equal bit for bit to forward().
  std::pair<at::Tensor, at::Tensor> forward_deferred(const at::Tensor& x, const at::Tensor& pending,
                                                     const at::Tensor& context);
  LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};
  Attention attn1{nullptr}, attn2{nullptr};
  FeedForward ff{nullptr};
};
TORCH_MODULE(BasicTransformerBlock);

// diffusers' Transformer2DModel over a feature map (continuous input).
class Transformer2DModelImpl : public torch::nn::Module {
 public:
  Transformer2DModelImpl(int64_t channels, int64_t heads, int64_t layers, int64_t cross_attention_dim, int64_t groups,
                         bool linear_projection);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context);  // [B, C, H, W] -> [B, C, H, W]
  bool linear_projection;
  GroupNorm norm{nullptr};
  // "proj_in" / "proj_out": linear (SD 2.x, SDXL) or 1x1 convolutions (SD 1.5); one of each pair exists.
  Linear proj_in_linear{nullptr}, proj_out_linear{nullptr};
  Conv2d proj_in_conv{nullptr}, proj_out_conv{nullptr};
  torch::nn::ModuleList transformer_blocks{nullptr};
};
TORCH_MODULE(Transformer2DModel);

// One down block: resnets (+ attentions) and an optional downsampler.
class DownBlockImpl : public torch::nn::Module {
 public:
  DownBlockImpl(const UNet2DConditionConfig& c, size_t index, int64_t in_channels, int64_t out_channels);
  // Appends every intermediate output (for the skip connections) to `skips`.
  at::Tensor forward(at::Tensor x, const at::Tensor& temb, const at::Tensor& context, std::vector<at::Tensor>& skips);
  torch::nn::ModuleList resnets{nullptr}, attentions{nullptr}, downsamplers{nullptr};
};
TORCH_MODULE(DownBlock);

class MidBlockImpl : public torch::nn::Module {
 public:
  explicit MidBlockImpl(const UNet2DConditionConfig& c);
  at::Tensor forward(at::Tensor x, const at::Tensor& temb, const at::Tensor& context);
  torch::nn::ModuleList resnets{nullptr}, attentions{nullptr};
};
TORCH_MODULE(MidBlock);

class UpBlockImpl : public torch::nn::Module {
 public:
  UpBlockImpl(const UNet2DConditionConfig& c, size_t index, int64_t prev_channels, int64_t out_channels,
              const std::vector<int64_t>& skip_channels);
  // Consumes its skips from the back of `skips`; `upsample_size` is the next skip's size.
  at::Tensor forward(at::Tensor x, const at::Tensor& temb, const at::Tensor& context, std::vector<at::Tensor>& skips,
                     at::IntArrayRef upsample_size);
  // Resnets (+ attentions) [begin, end) only, then the upsampler when `upsample`; forward() is
  // (0, all, true). The hybrid window's stages resume a block where the other stage stopped.
  at::Tensor forward_part(at::Tensor x, const at::Tensor& temb, const at::Tensor& context,
                          std::vector<at::Tensor>& skips, size_t begin, size_t end, bool upsample,
                          at::IntArrayRef upsample_size);
  torch::nn::ModuleList resnets{nullptr}, attentions{nullptr}, upsamplers{nullptr};
};
TORCH_MODULE(UpBlock);

// The outer stage's state between its two halves (UNet2DConditionModelImpl::forward_outer_down).
struct UNetOuterState {
  at::Tensor temb;                 // [B, time_embed_dim]
  at::Tensor h;                    // the inner stage's input: down_blocks[split]'s input, [B, C, h', w']
  std::vector<at::Tensor> skips;   // the skips the outer up layers consume, in production order
};

// AsyncDiff's sequential view of the UNet (UNet2DConditionModelImpl::forward_range): the state
// between two layers of the flat execution order.
struct UNetStageState {
  at::Tensor h;                   // the running hidden state; the sample before layer 0, the output after the last
  at::Tensor temb;                // [B, time_embed_dim] at the step being evaluated
  std::vector<at::Tensor> skips;  // the skip connections produced and not yet consumed, in production order
};

// One layer of that order: its name (the diffusers module it runs, e.g. "down_blocks.1.resnets.0"
// with its attention), its weights and an estimated cost at one latent size.
struct UNetLayerInfo {
  std::string name;
  std::int64_t parameters = 0;
  double cost = 0;  // multiply-adds, estimated (UNet2DConditionModelImpl::layer_info)
};

class UNet2DConditionModelImpl : public torch::nn::Module {
 public:
  explicit UNet2DConditionModelImpl(const UNet2DConditionConfig& c);
  // sample: [B, Cin, H, W]; timesteps: [B] (float); cond as above -> [B, Cout, H, W].
  at::Tensor forward(const at::Tensor& sample, const at::Tensor& timesteps, const UNetConditioning& cond);
  // The time (+ added) embedding alone: [B] -> [B, time_embed_dim].
  at::Tensor embed_time(const at::Tensor& timesteps, const UNetConditioning& cond, c10::ScalarType dtype);

  // The "U split" at down block `split` (1 <= split < down blocks) used by hybrid CFG's stale
  // window. Inner stage: down_blocks[split..], the mid block and the up layers that consume
  // their skips. Outer stage: conv_in, down_blocks[..split), the remaining up layers, the output.
  // forward(x) == forward_outer_up(s, forward_inner(s.h, t), t) with s = forward_outer_down(x, t).
  // sample [B, Cin, H, W], timesteps [B] -> the state (h: [B, ch[split-1], H/2^split, W/2^split]).
  UNetOuterState forward_outer_down(const at::Tensor& sample, const at::Tensor& timesteps, const UNetConditioning& cond,
                                    int split);
  // h [B, ch[split-1], h', w'] -> [B, ch[split], h', w'] (the hidden after the last up layer that
  // consumes an inner skip).
  at::Tensor forward_inner(const at::Tensor& h, const at::Tensor& timesteps, const UNetConditioning& cond, int split);
  // The state (its skips are consumed) and the inner output [B, ch[split], h', w'] -> [B, Cout, H, W].
  at::Tensor forward_outer_up(UNetOuterState state, const at::Tensor& inner, const UNetConditioning& cond, int split);

  // The sequential split AsyncDiff needs: the model as a flat list of layers in execution order,
  //   conv_in | per down block: each resnet (+ its attention), the downsampler |
  //   mid_block.0 (resnet 0 + attention) | mid_block.1 (resnet 1) |
  //   per up block: each resnet (+ its attention; it consumes one skip), the upsampler | the head
  //   (conv_norm_out, SiLU, conv_out),
  // each a function of the state: forward(x, t, c) == forward_range(stage_begin(x, t, c), 0,
  // layer_count(), c).h, bit for bit, and forward_range over [a, b) then [b, c) is [a, c).
  int layer_count() const { return static_cast<int>(layers_.size()); }
  // The state before layer 0: h = sample, temb = embed_time(timesteps), no skips.
  UNetStageState stage_begin(const at::Tensor& sample, const at::Tensor& timesteps, const UNetConditioning& cond);
  // Runs layers [begin, end) on the state in place with its temb and cond's context.
  void forward_range(UNetStageState& state, int begin, int end, const UNetConditioning& cond);
  // DeepCache's split of that order (models/common/block_cache.h): the shallow path is layers
  // [0, first) and [second, layer_count()): conv_in and the first `branch` down layers, then the
  // up layers that consume their skips (the last branch + 1 up resnets, with the upsamplers among
  // them) and the head. The deep feature is the hidden state entering layer `second`. `branch`
  // runs from 0 (DeepCache's default for SD / SDXL) to the number of down layers (the deep path
  // then the mid block alone); others are a diffract::Error.
  std::pair<int, int> deep_cache_split(int branch) const;
  // Every layer's name, parameters and estimated cost for latents of height x width: each weight
  // applied once per output position at the layer's resolution (convolutions, linear
  // projections; the cross-attention K/V projections, which see the text tokens only, are
  // over-counted), plus 2 T^2 C per self-attention (scores and weighted values; T tokens of C
  // channels). The time embedding, which every stage runs, is left out.
  std::vector<UNetLayerInfo> layer_info(std::int64_t height, std::int64_t width) const;
  // The shapes of the state's tensors before layer `layer` (h first, then the skips in order)
  // for `rows` rows of height x width latents; temb is not counted (each stage makes its own).
  std::vector<std::vector<std::int64_t>> stage_shapes(int layer, std::int64_t rows, std::int64_t height,
                                                      std::int64_t width) const;

  // The cross-attentions' keys and values from one GEMM per forward() (CrossKV, attention.h);
  // returns how many cross-attentions take part. The pipelines do it unless
  // DIFFRACT_FUSED_CROSS_KV=0. The stage calls keep the per-layer GEMMs (they run a part of the
  // layers).
  int fuse_cross_attention_kv();
  // The ResNet blocks' time-embedding projections as one GEMM per forward() (TimeProjections,
  // resnet.h); returns how many blocks take part. The pipelines do it unless
  // DIFFRACT_FUSED_TIME_PROJ=0; the stage calls keep the per-block GEMMs.
  int fuse_time_projections();

  UNet2DConditionConfig config;
  Conv2d conv_in{nullptr}, conv_out{nullptr};
  TimestepEmbedding time_embedding{nullptr}, add_embedding{nullptr};
  torch::nn::ModuleList down_blocks{nullptr}, up_blocks{nullptr};
  MidBlock mid_block{nullptr};
  GroupNorm conv_norm_out{nullptr};

 private:
  struct Layer {
    enum class Kind { ConvIn, Down, Downsample, Mid, Up, Upsample, Head } kind;
    int block = 0, index = 0;  // down / up block and resnet (mid: 0 or 1)
  };
  std::vector<Layer> layers_;
  std::shared_ptr<CrossKV> cross_kv_;
  std::shared_ptr<TimeProjections> time_projections_;
  std::string layer_name(const Layer& l) const;

  struct SplitPoint {
    size_t up_block = 0, up_resnet = 0;  // where the outer stage resumes the up path
  };
  SplitPoint split_point(int split) const;
  at::Tensor run_up(at::Tensor x, const at::Tensor& temb, const at::Tensor& context, std::vector<at::Tensor>& skips,
                    SplitPoint from, SplitPoint to);
};
TORCH_MODULE(UNet2DConditionModel);

UNet2DConditionModel load_unet_2d_condition(const std::filesystem::path& dir, const std::string& variant = "");

}  // namespace diffract::models
