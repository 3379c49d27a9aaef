#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "core/models/common/layers.h"

namespace diffract::models {

// transformers' T5Config as far as the encoder reads it, spelled as config.json spells it.
// Defaults are T5Config's (the original T5: relu FFN); SD3's t5xxl is T5 v1.1: "gated-gelu".
struct T5EncoderOptions {
  int64_t vocab_size = 32128;
  int64_t d_model = 512;
  int64_t d_kv = 64;
  int64_t d_ff = 2048;
  int64_t num_layers = 6;
  int64_t num_heads = 8;
  int64_t relative_attention_num_buckets = 32;
  int64_t relative_attention_max_distance = 128;
  double layer_norm_epsilon = 1e-6;
  std::string feed_forward_proj = "relu";  // "relu", "gelu", "gated-gelu", ...: [gated-]<activation>

  bool gated() const;               // wi_0, wi_1, wo instead of wi, wo
  std::string activation() const;   // "relu", "gelu_new" (what "gated-gelu" means), ...

  // Architecture keys are required; the rest default as transformers does.
  static T5EncoderOptions from_json(const std::filesystem::path& config_json);
};

// T5LayerNorm: RMS norm, no mean, no bias; the mean square in fp32.
class T5LayerNormImpl : public torch::nn::Module {
 public:
  T5LayerNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(T5LayerNorm);

class T5AttentionImpl : public torch::nn::Module {
 public:
  T5AttentionImpl(const T5EncoderOptions& o, bool has_relative_attention_bias);
  // [1, heads, q_len, k_len]: the bucketed relative-position bias (first layer only).
  at::Tensor compute_bias(int64_t q_len, int64_t k_len);
  // x [B, T, d_model], bias [1 or B, heads, T, T] -> [B, T, d_model]. Unscaled scores, as T5.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& bias);
  Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  Embedding relative_attention_bias{nullptr};  // has_relative_attention_bias only
  T5EncoderOptions options;
};
TORCH_MODULE(T5Attention);

class T5LayerSelfAttentionImpl : public torch::nn::Module {
 public:
  T5LayerSelfAttentionImpl(const T5EncoderOptions& o, bool has_relative_attention_bias);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& bias);
  T5Attention SelfAttention{nullptr};
  T5LayerNorm layer_norm{nullptr};
};
TORCH_MODULE(T5LayerSelfAttention);

// DenseReluDense holds either wi, wo (T5) or wi_0, wi_1, wo (gated, T5 v1.1); the checkpoint
// name is DenseReluDense in both cases.
class T5DenseImpl : public torch::nn::Module {
 public:
  explicit T5DenseImpl(const T5EncoderOptions& o);
  at::Tensor forward(const at::Tensor& x);
  Linear wi{nullptr}, wi_0{nullptr}, wi_1{nullptr}, wo{nullptr};
  std::string act;
};
TORCH_MODULE(T5Dense);

class T5LayerFFImpl : public torch::nn::Module {
 public:
  explicit T5LayerFFImpl(const T5EncoderOptions& o);
  at::Tensor forward(const at::Tensor& x);
  T5Dense DenseReluDense{nullptr};
  T5LayerNorm layer_norm{nullptr};
};
TORCH_MODULE(T5LayerFF);

// One block: layer.0 self-attention, layer.1 feed-forward, each pre-norm with a residual.
class T5BlockImpl : public torch::nn::Module {
 public:
  T5BlockImpl(const T5EncoderOptions& o, bool has_relative_attention_bias);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& bias);
  torch::nn::ModuleList layer{nullptr};
};
TORCH_MODULE(T5Block);

class T5StackImpl : public torch::nn::Module {
 public:
  explicit T5StackImpl(const T5EncoderOptions& o);
  torch::nn::ModuleList block{nullptr};
  T5LayerNorm final_layer_norm{nullptr};
};
TORCH_MODULE(T5Stack);

struct T5EncoderOutput {
  at::Tensor last_hidden_state;           // [B, T, d_model], after the final layer norm
  std::vector<at::Tensor> hidden_states;  // embeddings, then each block's output (when asked)
};

// transformers' T5EncoderModel: keys shared.weight, encoder.block.N.layer.0.SelfAttention.q.weight,
// ..., encoder.final_layer_norm.weight.
//
// Precision: T5 v1.1's activations outgrow fp16's range (transformers clamps them in fp16 and
// keeps `wo` in fp32 for it). This module runs in its parameters' dtype and refuses fp16; SD3's
// pipeline holds it in bf16 on CUDA (fp32's exponent range, so nothing overflows) and in fp32
// on the CPU, converting fp16 checkpoints when they are bound.
class T5EncoderImpl : public torch::nn::Module {
 public:
  explicit T5EncoderImpl(const T5EncoderOptions& o);
  // input_ids [B, T] int64, attention_mask [B, T] (1 keep, 0 masked; undefined: all tokens, as
  // diffusers' SD3 calls it) -> last_hidden_state [B, T, d_model].
  T5EncoderOutput forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                          bool output_hidden_states = false);
  T5EncoderOptions options;
  Embedding shared{nullptr};
  T5Stack encoder{nullptr};
};
TORCH_MODULE(T5Encoder);

// A transformers T5EncoderModel folder (config.json + model[.variant].safetensors or shards),
// strictly bound; a tensor whose shape does not fit the config is named in the error.
T5Encoder load_t5_encoder(const std::filesystem::path& dir, const std::string& variant = "");

}  // namespace diffract::models
