#pragma once
// Stable Diffusion 3 / 3.5's MMDiT denoiser, as diffusers' SD3Transformer2DModel: image patches
// and text tokens keep separate weights but attend jointly in every block. Module names are
// diffusers' state-dict keys, so a diffusers `transformer/` folder binds as is.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "core/io/single_file.h"
#include "core/models/common/attention.h"
#include "core/models/common/embeddings.h"
#include "core/models/common/fused_linears.h"
#include "core/models/common/layers.h"
#include "core/models/common/normalization.h"
#include "core/models/common/block_cache.h"
#include "core/models/common/sequence_parallel.h"

namespace diffract::models {

// diffusers' SD3Transformer2DModel constructor arguments.
struct SD3Transformer2DConfig {
  int64_t sample_size = 128;  // latent size the position grid was trained around (base size of the sincos grid)
  int64_t patch_size = 2;
  int64_t in_channels = 16;
  int64_t num_layers = 18;
  int64_t attention_head_dim = 64;
  int64_t num_attention_heads = 18;
  int64_t joint_attention_dim = 4096;     // text features in (CLIP-L + CLIP-G + T5)
  int64_t caption_projection_dim = 1152;  // context_embedder's output: the blocks' width
  int64_t pooled_projection_dim = 2048;
  int64_t out_channels = 16;
  int64_t pos_embed_max_size = 96;        // side of the stored position grid, cropped to the latent's patches
  std::vector<int64_t> dual_attention_layers;  // SD3.5 medium: blocks with a second, image-only attention
  std::string qk_norm;                    // "" or "rms_norm" (SD3.5)

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  bool dual_attention(int64_t layer) const;

  static SD3Transformer2DConfig sd3_medium();   // 24 layers, 24 heads, no qk norm
  static SD3Transformer2DConfig sd35_medium();  // + rms qk norm, dual attention in blocks 0..12, 384 grid
  static SD3Transformer2DConfig sd35_large();   // 38 layers, 38 heads, rms qk norm
  // config.json; unsupported values and inconsistent sizes are errors naming the file and key.
  static SD3Transformer2DConfig from_json(const std::filesystem::path& config_json);
  // From tensor names and shapes alone (never the data), for files without a config. The head
  // width comes from the qk-norm weights when there are any, else it is `head_dim` (64 in every
  // SD3 release); sample_size keeps its default (it only seeds the stored position grid).
  // Errors name `what` and the missing or odd tensor.
  static SD3Transformer2DConfig from_shapes(const std::vector<io::TensorShape>& tensors, const std::string& what,
                                            int64_t head_dim = 64);
  // Throws an error starting with `where` for sizes the model cannot be built with.
  void validate(const std::string& where) const;
};

// diffusers' Attention with JointAttnProcessor2_0. Joint: image tokens (to_q/k/v) and text
// tokens (add_q/k/v_proj) are projected separately, optionally RMS-normed per head (norm_q,
// norm_k, norm_added_q, norm_added_k), attend as one sequence, and are split again: to_out.0 for
// the image part, to_add_out for the text part (absent where the text is not used afterwards).
// Without `joint` it is plain self-attention over the image tokens (SD3.5's attn2).
struct JointAttentionOptions {
  int64_t dim = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  bool qk_norm = false;
  bool joint = true;
  bool context_pre_only = false;  // joint only: no to_add_out
};

class JointAttentionImpl : public torch::nn::Module {
 public:
  explicit JointAttentionImpl(const JointAttentionOptions& o);
  // x [B, N, D], context [B, S, D] (joint) -> {x' [B, N, D], context' [B, S, D] or undefined}.
  // With `cache`, x holds image tokens [begin, begin + N) of the image the cache covers: their
  // keys and values go into the cache (which an undefined cache takes whole when x is the whole
  // image), and the image keys and values attended over are the cache's. With `shard` (no cache)
  // x holds this rank's share of the image tokens and the attention is Ulysses' (sequence_parallel.h).
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& context = {},
                                            ImageKV* cache = nullptr, int64_t begin = 0,
                                            const SequenceShard* shard = nullptr);
  // to_q, to_k, to_v as one GEMM, and add_q_proj, add_k_proj, add_v_proj as another
  // (fused_linears.h; the pipelines call it unless DIFFRACT_FUSED_QKV=0).
  void fuse_projections();
  JointAttentionOptions options;
  Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  Linear add_q_proj{nullptr}, add_k_proj{nullptr}, add_v_proj{nullptr}, to_add_out{nullptr};
  RMSNorm norm_q{nullptr}, norm_k{nullptr}, norm_added_q{nullptr}, norm_added_k{nullptr};
  torch::nn::ModuleList to_out{nullptr};

 private:
  std::shared_ptr<FusedLinears> qkv_, added_qkv_;  // set by fuse_projections()
};
TORCH_MODULE(JointAttention);

// diffusers' JointTransformerBlock (MM-DiT block). The last block is context_pre_only: its
// text stream is only read (AdaLayerNormContinuous, no text output or feed-forward).
class JointTransformerBlockImpl : public torch::nn::Module {
 public:
  JointTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim, bool context_pre_only, bool qk_norm,
                            bool dual_attention);
  // x [B, N, D], context [B, S, D], temb [B, D] -> {context' [B, S, D] (undefined when
  // context_pre_only), x' [B, N, D]}, in diffusers' order. `cache` / `begin`: the attentions'
  // image K/V caches (attn, attn2) when x is a patch of the image (JointAttention::forward).
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& context, const at::Tensor& temb,
                                            ImageKV* cache = nullptr, ImageKV* cache2 = nullptr, int64_t begin = 0,
                                            const SequenceShard* shard = nullptr);
  bool context_pre_only, dual_attention;
  AdaLayerNormZero norm1{nullptr}, norm1_context_zero{nullptr};  // the latter registered as "norm1_context"
  AdaLayerNormContinuous norm1_context_continuous{nullptr};       // "norm1_context" of the last block
  JointAttention attn{nullptr}, attn2{nullptr};
  FeedForward ff{nullptr}, ff_context{nullptr};
};
TORCH_MODULE(JointTransformerBlock);

// diffusers' PatchEmbed with SD3's cropping: a patch_size-strided conv ("proj") to tokens plus
// the centre crop of the stored pos_embed_max_size² sincos grid ("pos_embed" buffer).
class SD3PatchEmbedImpl : public torch::nn::Module {
 public:
  explicit SD3PatchEmbedImpl(const SD3Transformer2DConfig& c);
  at::Tensor forward(const at::Tensor& latent);  // [B, C, H, W] -> [B, (H/p)*(W/p), D]
  // Latent rows [row0, row0 + h) of a latent `full_height` rows high: its tokens as forward()
  // of the whole latent gives them (row0, h and full_height multiples of the patch size).
  at::Tensor forward_rows(const at::Tensor& rows, int64_t row0, int64_t full_height);
  // The position embeddings of an h x w patch grid: [1, h*w, D]. Errors past the stored grid.
  at::Tensor cropped_pos_embed(int64_t h, int64_t w) const;
  int64_t patch_size, max_size;
  Conv2d proj{nullptr};
  at::Tensor pos_embed;
};
TORCH_MODULE(SD3PatchEmbed);

// diffusers' CombinedTimestepTextProjEmbeddings: sinusoidal(t, 256) through timestep_embedder
// plus the pooled text through text_embedder (linear, SiLU, linear: the same layout).
class CombinedTimestepTextProjEmbeddingsImpl : public torch::nn::Module {
 public:
  CombinedTimestepTextProjEmbeddingsImpl(int64_t dim, int64_t pooled_dim);
  at::Tensor forward(const at::Tensor& timestep, const at::Tensor& pooled);  // [B], [B, P] -> [B, D]
  TimestepEmbedding timestep_embedder{nullptr}, text_embedder{nullptr};
};
TORCH_MODULE(CombinedTimestepTextProjEmbeddings);

// One block's image K/V caches (attn2's only for SD3.5's dual-attention blocks).
struct SD3BlockCache {
  ImageKV attn, attn2;
};

// The streams between blocks: what a model-level strategy (PipeFusion, ...) splits and passes on.
struct SD3State {
  at::Tensor x;        // image tokens [B, N, D]
  at::Tensor context;  // text tokens [B, S, D] (undefined after the last block)
  at::Tensor temb;     // [B, D]
  int64_t height = 0, width = 0;  // latent size
  const SequenceShard* shard = nullptr;  // sequence parallelism: x holds this rank's image tokens
};

class SD3Transformer2DModelImpl : public torch::nn::Module {
 public:
  explicit SD3Transformer2DModelImpl(const SD3Transformer2DConfig& c);
  // hidden_states [B, Cin, H, W] (H, W multiples of patch_size), encoder_hidden_states [B, S,
  // joint_attention_dim], pooled_projections [B, pooled_projection_dim], timestep [B] or a scalar
  // (sigma * 1000, float) -> the velocity [B, Cout, H, W].
  // With `shard` (sequence parallelism: every rank of its exchange calls in step with the whole
  // latents) each rank runs its share of the image tokens through the blocks, and the outputs are
  // all-gathered before the unpatchify: the whole velocity on every rank.
  at::Tensor forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                     const at::Tensor& pooled_projections, const at::Tensor& timestep,
                     const SequenceShard* shard = nullptr);
  // forward() with a First-Block Cache (block_cache.h): the first joint block always, the others
  // only when `cache` says its image residual moved enough since they last ran.
  at::Tensor forward_cached(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                            const at::Tensor& pooled_projections, const at::Tensor& timestep, FirstBlockCache& cache);
  // forward() with a TeaCache (block_cache.h): every block, or none while the first block's
  // modulated image input moved little since the last steps; the cache keeps the blocks' residual.
  at::Tensor forward_teacached(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                               const at::Tensor& pooled_projections, const at::Tensor& timestep, TeaCache& cache);
  // forward in three parts, for strategies that run blocks separately:
  SD3State embed(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                 const at::Tensor& pooled_projections, const at::Tensor& timestep);
  void run_block(size_t index, SD3State& state);
  // The same on image tokens [begin, begin + n) of the image the cache covers (PipeFusion).
  void run_block(size_t index, SD3State& state, SD3BlockCache& cache, int64_t begin);
  // norm_out, proj_out -> [B, Cout, height, width] (state.x: the tokens of those latent rows).
  at::Tensor unpatchify_output(const SD3State& state);
  // Every attention's projections fused (JointAttentionImpl::fuse_projections).
  void fuse_projections();

  SD3Transformer2DConfig config;
  SD3PatchEmbed pos_embed{nullptr};
  CombinedTimestepTextProjEmbeddings time_text_embed{nullptr};
  Linear context_embedder{nullptr}, proj_out{nullptr};
  torch::nn::ModuleList transformer_blocks{nullptr};
  AdaLayerNormContinuous norm_out{nullptr};
};
TORCH_MODULE(SD3Transformer2DModel);

// A diffusers `transformer/` folder: config.json and diffusion_pytorch_model(.variant).safetensors
// (or a shard index). Errors name the file and the key.
SD3Transformer2DModel load_sd3_transformer(const std::filesystem::path& dir, const std::string& variant = "");

}  // namespace diffract::models
