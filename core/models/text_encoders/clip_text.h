#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "core/models/common/attention.h"
#include "core/models/common/layers.h"

namespace diffract::models {

// transformers' CLIPTextConfig, as its config.json spells it.
struct CLIPTextConfig {
  int64_t vocab_size = 49408;
  int64_t hidden_size = 768;
  int64_t intermediate_size = 3072;
  int64_t projection_dim = 768;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t max_position_embeddings = 77;
  std::string hidden_act = "quick_gelu";
  double layer_norm_eps = 1e-5;
  int64_t eos_token_id = 2;  // 2 means "legacy": the pooled token is the highest id (argmax)

  static CLIPTextConfig clip_l();        // SD 1.5 / SDXL text_encoder
  static CLIPTextConfig open_clip_h();   // SD 2.x text_encoder
  static CLIPTextConfig open_clip_bigg();  // SDXL text_encoder_2
  // Architecture keys are required; the rest default as transformers does.
  static CLIPTextConfig from_json(const std::filesystem::path& config_json);
};

struct CLIPTextOutput {
  at::Tensor last_hidden_state;            // [B, T, C], after the final layer norm
  at::Tensor pooled;                       // [B, C], at the EOS token
  at::Tensor text_embeds;                  // [B, P], projected pooled (WithProjection only)
  std::vector<at::Tensor> hidden_states;   // embeddings, then each layer's output (when asked)
};

class CLIPTextEmbeddingsImpl : public torch::nn::Module {
 public:
  explicit CLIPTextEmbeddingsImpl(const CLIPTextConfig& c);
  at::Tensor forward(const at::Tensor& input_ids);
  Embedding token_embedding{nullptr}, position_embedding{nullptr};
};
TORCH_MODULE(CLIPTextEmbeddings);

class CLIPAttentionImpl : public torch::nn::Module {
 public:
  explicit CLIPAttentionImpl(const CLIPTextConfig& c);
  at::Tensor forward(const at::Tensor& x);
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
  int64_t heads;
};
TORCH_MODULE(CLIPAttention);

class CLIPMLPImpl : public torch::nn::Module {
 public:
  explicit CLIPMLPImpl(const CLIPTextConfig& c);
  at::Tensor forward(const at::Tensor& x);
  Linear fc1{nullptr}, fc2{nullptr};
  Activation act;
};
TORCH_MODULE(CLIPMLP);

class CLIPEncoderLayerImpl : public torch::nn::Module {
 public:
  explicit CLIPEncoderLayerImpl(const CLIPTextConfig& c);
  at::Tensor forward(const at::Tensor& x);
  CLIPAttention self_attn{nullptr};
  torch::nn::LayerNorm layer_norm1{nullptr}, layer_norm2{nullptr};
  CLIPMLP mlp{nullptr};
};
TORCH_MODULE(CLIPEncoderLayer);

class CLIPEncoderImpl : public torch::nn::Module {
 public:
  explicit CLIPEncoderImpl(const CLIPTextConfig& c);
  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(CLIPEncoder);

class CLIPTextTransformerImpl : public torch::nn::Module {
 public:
  explicit CLIPTextTransformerImpl(const CLIPTextConfig& c);
  // input_ids: [B, T] int64 -> last_hidden_state, pooled (and hidden_states when asked).
  CLIPTextOutput forward(const at::Tensor& input_ids, bool output_hidden_states = false);
  CLIPTextConfig config;
  CLIPTextEmbeddings embeddings{nullptr};
  CLIPEncoder encoder{nullptr};
  torch::nn::LayerNorm final_layer_norm{nullptr};
};
TORCH_MODULE(CLIPTextTransformer);

// transformers' CLIPTextModel: keys text_model.*.
class CLIPTextModelImpl : public torch::nn::Module {
 public:
  explicit CLIPTextModelImpl(const CLIPTextConfig& c);
  CLIPTextOutput forward(const at::Tensor& input_ids, bool output_hidden_states = false);
  CLIPTextTransformer text_model{nullptr};
};
TORCH_MODULE(CLIPTextModel);

// transformers' CLIPTextModelWithProjection: text_model.* plus text_projection (no bias).
class CLIPTextModelWithProjectionImpl : public torch::nn::Module {
 public:
  explicit CLIPTextModelWithProjectionImpl(const CLIPTextConfig& c);
  CLIPTextOutput forward(const at::Tensor& input_ids, bool output_hidden_states = false);
  CLIPTextTransformer text_model{nullptr};
  Linear text_projection{nullptr};
};
TORCH_MODULE(CLIPTextModelWithProjection);

// A transformers text-encoder folder (config.json + model[.variant].safetensors), strictly bound.
CLIPTextModel load_clip_text_model(const std::filesystem::path& dir, const std::string& variant = "");
CLIPTextModelWithProjection load_clip_text_model_with_projection(const std::filesystem::path& dir,
                                                                 const std::string& variant = "");

}  // namespace diffract::models
