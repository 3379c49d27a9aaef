#pragma once
// Flux.1's denoiser, as diffusers' FluxTransformer2DModel: 19 double-stream blocks (text and image
// tokens with their own weights, attending jointly, as SD3's MMDiT) then 38 single-stream blocks
// (one sequence, attention and MLP side by side), rotary position embeddings over (text, image)
// ids, AdaLN modulation by the timestep, pooled CLIP and, for the guidance-distilled dev, the
// guidance embedding. It works on packed latents: 2x2 patches of the 16-channel latent as 64
// features a token (the pipeline packs and unpacks). Module names are diffusers' state-dict keys.
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "core/io/single_file.h"
#include "core/models/common/attention.h"
#include "core/models/common/block_cache.h"
#include "core/models/common/embeddings.h"
#include "core/models/common/fused_linears.h"
#include "core/models/common/layers.h"
#include "core/models/common/normalization.h"
#include "core/models/common/rotary.h"
#include "core/models/common/sequence_parallel.h"

namespace diffract::models {

// diffusers' FluxTransformer2DModel constructor arguments.
struct FluxTransformer2DConfig {
  int64_t patch_size = 1;
  int64_t in_channels = 64;   // packed: 4 x the VAE's latent channels
  int64_t out_channels = 64;
  int64_t num_layers = 19;          // double-stream blocks
  int64_t num_single_layers = 38;   // single-stream blocks
  int64_t attention_head_dim = 128;
  int64_t num_attention_heads = 24;
  int64_t joint_attention_dim = 4096;  // T5's features
  int64_t pooled_projection_dim = 768;  // CLIP-L's pooled output
  bool guidance_embeds = false;         // dev: true (distilled guidance); schnell: false
  std::vector<int64_t> axes_dims_rope = {16, 56, 56};  // rotary widths per id axis; they sum to the head width

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  int64_t mlp_dim() const { return 4 * inner_dim(); }

  static FluxTransformer2DConfig dev();      // Flux.1-dev: guidance embedding
  static FluxTransformer2DConfig schnell();  // Flux.1-schnell: none
  // config.json; unsupported values and inconsistent sizes are errors naming the file and key.
  static FluxTransformer2DConfig from_json(const std::filesystem::path& config_json);
  // From diffusers-named tensor shapes alone (single files after their key map). Errors name
  // `what` and the missing or odd tensor.
  static FluxTransformer2DConfig from_shapes(const std::vector<io::TensorShape>& tensors, const std::string& what);
  // Throws an error starting with `where` for sizes the model cannot be built with.
  void validate(const std::string& where) const;
};

// The rotary embedding of a joint sequence: per token its cos and sin, [S, head_dim] float32,
// each frequency twice in a row (diffusers' repeat_interleave_real).
using FluxRope = Rope;

// diffusers' FluxPosEmbed (theta 10000): ids [S, axes] (positions per axis: Flux's are 0 for
// text, (0, row, column) for image tokens) -> the rope over axes_dims, in float64 then float32.
FluxRope flux_rope(const at::Tensor& ids, const std::vector<int64_t>& axes_dims, double theta = 10000.0);

// A PipeFusion pass (core/parallel/pipefusion.h) over a row patch of the image: the image tokens
// given are [begin, begin + n) of the image whose keys and values `kv` holds; the attention writes
// theirs into it and attends over the whole image's (the other rows as `kv` last saw them).
struct FluxPatch {
  ImageKV* kv = nullptr;
  int64_t begin = 0;
  int64_t text_tokens = 0;  // where the image starts in the single-stream blocks' joint sequence
};

// diffusers' FluxAttention with FluxAttnProcessor: q/k/v with bias, per-head RMS norms (norm_q,
// norm_k), rope on the joint sequence, SDPA. With `joint` the text stream has its own projections
// (add_*_proj, norm_added_*, to_add_out) and comes first in the sequence; the single-stream blocks'
// attention is `pre_only` (no output projection: the block's proj_out takes it).
struct FluxAttentionOptions {
  int64_t dim = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  bool joint = true;
  bool pre_only = false;
};

class FluxAttentionImpl : public torch::nn::Module {
 public:
  explicit FluxAttentionImpl(const FluxAttentionOptions& o);
  // joint: x [B, N, D] (image), context [B, S, D] (text), rope over S + N -> {image [B, N, D], text [B, S, D]}.
  // not joint: x [B, T, D] -> {[B, T, H*D], undefined}.
  // With `shard` the image tokens are this rank's share and the attention is Ulysses'
  // (sequence_parallel.h): every rank calls it in step; the rope is that of the rows given.
  // With `patch` (not with `shard`) the image tokens are a row patch's, attending over the
  // whole image's keys and values (FluxPatch).
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& context, const FluxRope& rope,
                                            const SequenceShard* shard = nullptr, const FluxPatch* patch = nullptr);
  // forward() from the image (or joint) stream's projections q, k, v [B, T, H*D] already made.
  std::pair<at::Tensor, at::Tensor> attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& context, const FluxRope& rope,
                                           const SequenceShard* shard = nullptr, const FluxPatch* patch = nullptr);
  // to_q, to_k, to_v as one GEMM, and add_q_proj, add_k_proj, add_v_proj as another (fused_linears.h).
  void fuse_projections();
  FluxAttentionOptions options;
  Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  RMSNorm norm_q{nullptr}, norm_k{nullptr};
  Linear add_q_proj{nullptr}, add_k_proj{nullptr}, add_v_proj{nullptr}, to_add_out{nullptr};
  RMSNorm norm_added_q{nullptr}, norm_added_k{nullptr};
  torch::nn::ModuleList to_out{nullptr};

 private:
  std::shared_ptr<FusedLinears> qkv_, added_qkv_;
};
TORCH_MODULE(FluxAttention);

// diffusers' FluxTransformerBlock (double stream).
class FluxTransformerBlockImpl : public torch::nn::Module {
 public:
  FluxTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim);
  // x [B, N, D], context [B, S, D], temb [B, D] -> {context' [B, S, D], x' [B, N, D]}, in diffusers' order.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& context, const at::Tensor& temb,
                                            const FluxRope& rope, const SequenceShard* shard = nullptr,
                                            const FluxPatch* patch = nullptr);
  AdaLayerNormZero norm1{nullptr}, norm1_context{nullptr};
  FluxAttention attn{nullptr};
  FeedForward ff{nullptr}, ff_context{nullptr};
};
TORCH_MODULE(FluxTransformerBlock);

// diffusers' FluxSingleTransformerBlock: on the joint sequence [text; image], attention and a
// GELU-tanh MLP from one modulated norm, concatenated into proj_out, gated, added.
class FluxSingleTransformerBlockImpl : public torch::nn::Module {
 public:
  FluxSingleTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim);
  // x [B, S + N, D] (text first), temb [B, D] -> [B, S + N, D]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& temb, const FluxRope& rope,
                     const SequenceShard* shard = nullptr, const FluxPatch* patch = nullptr);
  // attn's to_q, to_k, to_v and proj_mlp, which read the same norm, as one GEMM (BFL's linear1).
  void fuse_projections();
  AdaLayerNormZeroSingle norm{nullptr};
  Linear proj_mlp{nullptr}, proj_out{nullptr};
  FluxAttention attn{nullptr};

 private:
  std::shared_ptr<FusedLinears> in_;
};
TORCH_MODULE(FluxSingleTransformerBlock);

// diffusers' CombinedTimestep(Guidance)TextProjEmbeddings: sinusoidal(t * 1000, 256) through
// timestep_embedder, plus (dev) sinusoidal(guidance * 1000, 256) through guidance_embedder, plus
// the pooled text through text_embedder (linear, SiLU, linear).
class FluxTimeTextEmbeddingsImpl : public torch::nn::Module {
 public:
  FluxTimeTextEmbeddingsImpl(int64_t dim, int64_t pooled_dim, bool guidance);
  // timestep [B] (sigma in 0..1), guidance [B] or undefined, pooled [B, P] -> [B, D]
  at::Tensor forward(const at::Tensor& timestep, const at::Tensor& guidance, const at::Tensor& pooled);
  TimestepEmbedding timestep_embedder{nullptr}, guidance_embedder{nullptr}, text_embedder{nullptr};
};
TORCH_MODULE(FluxTimeTextEmbeddings);

// The streams between blocks, for strategies that run blocks separately. Before the single
// blocks `context` and `x` are separate; from the first single block on `x` is the joint
// sequence [text; image] and `text_tokens` says where the image starts.
struct FluxState {
  at::Tensor x;        // image tokens [B, N, D], or the joint sequence [B, S + N, D]
  at::Tensor context;  // text tokens [B, S, D]; undefined once joined
  at::Tensor temb;     // [B, D]
  FluxRope rope;
  int64_t text_tokens = 0;
  bool joined = false;
  const SequenceShard* shard = nullptr;  // sequence parallelism: x holds this rank's image tokens
};

class FluxTransformer2DModelImpl : public torch::nn::Module {
 public:
  explicit FluxTransformer2DModelImpl(const FluxTransformer2DConfig& c);
  // hidden_states [B, N, in_channels] (packed latents), encoder_hidden_states [B, S,
  // joint_attention_dim], pooled_projections [B, pooled_projection_dim], timestep [B] or a
  // scalar (sigma: the pipeline's t / 1000), guidance [B] or undefined (dev: the distilled
  // guidance scale), rope of the ids [S + N, 3] (text first) -> [B, N, out_channels].
  // With `shard` (sequence parallelism) hidden_states and the rope's image rows are this rank's
  // share of the image tokens, and so is the output; every rank of the exchange calls it in step.
  at::Tensor forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                     const at::Tensor& pooled_projections, const at::Tensor& timestep, const at::Tensor& guidance,
                     const FluxRope& rope, const SequenceShard* shard = nullptr);
  // forward() with a First-Block Cache (block_cache.h): the first block always, the others only
  // when `cache` says the first block's residual moved enough since they last ran (cache.reused
  // says which); the cache keeps the image stream's residuals.
  at::Tensor forward_cached(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                            const at::Tensor& pooled_projections, const at::Tensor& timestep, const at::Tensor& guidance,
                            const FluxRope& rope, FirstBlockCache& cache);
  // forward() with a TeaCache (block_cache.h), as TeaCache4FLUX: every block, or none while the
  // first block's modulated image input moved little since the last steps (the cache keeps the
  // blocks' image residual).
  at::Tensor forward_teacached(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                               const at::Tensor& pooled_projections, const at::Tensor& timestep,
                               const at::Tensor& guidance, const FluxRope& rope, TeaCache& cache);
  // The rope of txt_ids [S, 3] and img_ids [N, 3], as forward() takes it.
  FluxRope rope(const at::Tensor& txt_ids, const at::Tensor& img_ids) const;
  // forward in parts: embed, then blocks 0 .. num_blocks() - 1 (double, then single), then the output.
  FluxState embed(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                  const at::Tensor& pooled_projections, const at::Tensor& timestep, const at::Tensor& guidance,
                  const FluxRope& rope);
  size_t num_blocks() const;
  void run_block(size_t index, FluxState& state);
  // The same on image tokens [begin, begin + n) of the image `kv` covers (PipeFusion; FluxPatch):
  // state.x holds those tokens (and the text first once joined), state.rope their rows.
  void run_block(size_t index, FluxState& state, ImageKV& kv, int64_t begin);
  at::Tensor output(const FluxState& state);  // norm_out, proj_out on the image tokens -> [B, N, out]
  // The blocks' projections that read one input as fewer, wider GEMMs, once the weights are in
  // place (a later move or dtype change undoes it: the layers then run apart until called again).
  void fuse_projections();

  FluxTransformer2DConfig config;
  FluxTimeTextEmbeddings time_text_embed{nullptr};
  Linear context_embedder{nullptr}, x_embedder{nullptr}, proj_out{nullptr};
  torch::nn::ModuleList transformer_blocks{nullptr}, single_transformer_blocks{nullptr};
  AdaLayerNormContinuous norm_out{nullptr};
};
TORCH_MODULE(FluxTransformer2DModel);

// A diffusers `transformer/` folder: config.json and diffusion_pytorch_model(.variant).safetensors
// (or a shard index). Errors name the file and the key.
FluxTransformer2DModel load_flux_transformer(const std::filesystem::path& dir, const std::string& variant = "");

// Packing between the VAE's latents and the transformer's tokens (diffusers' _pack_latents /
// _unpack_latents): [B, C, H, W] (H, W even) <-> [B, (H/2)*(W/2), 4C], each token a 2x2 patch,
// channels outermost.
at::Tensor pack_latents(const at::Tensor& latents);
at::Tensor unpack_latents(const at::Tensor& tokens, int64_t height, int64_t width);
// The image tokens' ids for a latent of height x width: (0, row, column) of each 2x2 patch, [N, 3].
at::Tensor latent_image_ids(int64_t height, int64_t width, const at::TensorOptions& options);

}  // namespace diffract::models
