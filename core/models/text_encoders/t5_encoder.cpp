#include "core/models/text_encoders/t5_encoder.h"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>

#include "core/io/diffusers_folder.h"
#include "core/io/json_file.h"
#include "core/io/key_maps.h"
#include "core/io/weights.h"
#include "core/models/common/attention.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace diffract::models {

namespace nn = torch::nn;

namespace {

// "gated-gelu" -> {true, "gelu"}; "relu" -> {false, "relu"}; anything else throws naming `where`.
std::pair<bool, std::string> parse_feed_forward_proj(const std::string& proj, const std::string& where) {
  const auto dash = proj.find('-');
  if (dash == std::string::npos) return {false, proj};
  const auto head = proj.substr(0, dash), act = proj.substr(dash + 1);
  if (head != "gated" || act.empty() || act.find('-') != std::string::npos)
    throw Error(where + ": feed_forward_proj '" + proj + "' is not of the form [gated-]<activation> ('relu', "
                "'gated-gelu')");
  return {true, act};
}

at::Tensor activate(const std::string& act, const at::Tensor& x) {
  if (act == "relu") return at::relu(x);
  return apply_activation(parse_activation(act, "T5 config"), x);
}

// transformers' bidirectional bucketing: half the buckets per direction; within one, exact
// distances below max_exact, then logarithmic bins up to max_distance, beyond it the last bin.
at::Tensor relative_position_bucket(const at::Tensor& relative, int64_t num_buckets, int64_t max_distance) {
  num_buckets /= 2;
  auto buckets = (relative > 0).to(at::kLong) * num_buckets;
  const auto n = relative.abs();
  const int64_t max_exact = num_buckets / 2;
  auto large = max_exact + (at::log(n.to(at::kFloat) / static_cast<double>(max_exact)) /
                            std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) *
                            static_cast<double>(num_buckets - max_exact))
                               .to(at::kLong);
  large = at::clamp_max(large, num_buckets - 1);
  return buckets + at::where(n < max_exact, n, large);
}

}  // namespace

bool T5EncoderOptions::gated() const { return parse_feed_forward_proj(feed_forward_proj, "T5 config").first; }

std::string T5EncoderOptions::activation() const {
  auto [gated, act] = parse_feed_forward_proj(feed_forward_proj, "T5 config");
  // transformers reads "gated-gelu" as the tanh approximation, for backwards compatibility.
  if (gated && act == "gelu") return "gelu_new";
  return act;
}

T5EncoderOptions T5EncoderOptions::from_json(const std::filesystem::path& path) {
  const auto j = io::JsonFile::read(path);
  const std::string where = path.string();
  T5EncoderOptions o;
  o.d_model = j.required<int64_t>("d_model");
  o.d_ff = j.required<int64_t>("d_ff");
  o.num_layers = j.required<int64_t>("num_layers");
  o.num_heads = j.required<int64_t>("num_heads");
  o.d_kv = j.optional<int64_t>("d_kv", 64);
  o.vocab_size = j.optional<int64_t>("vocab_size", 32128);
  o.relative_attention_num_buckets = j.optional<int64_t>("relative_attention_num_buckets", 32);
  o.relative_attention_max_distance = j.optional<int64_t>("relative_attention_max_distance", 128);
  o.layer_norm_epsilon = j.optional<double>("layer_norm_epsilon", 1e-6);
  o.feed_forward_proj = j.optional<std::string>("feed_forward_proj", "relu");
  for (auto [name, v] : {std::pair{"d_model", o.d_model}, {"d_kv", o.d_kv}, {"d_ff", o.d_ff},
                         {"num_layers", o.num_layers}, {"num_heads", o.num_heads}, {"vocab_size", o.vocab_size},
                         {"relative_attention_max_distance", o.relative_attention_max_distance}})
    if (v <= 0) throw Error(where + ": '" + name + "' must be positive, got " + std::to_string(v));
  if (o.relative_attention_num_buckets < 4)
    throw Error(where + ": relative_attention_num_buckets must be at least 4, got " +
                std::to_string(o.relative_attention_num_buckets));
  const auto [gated, act] = parse_feed_forward_proj(o.feed_forward_proj, where);
  (void)gated;
  if (act != "relu") parse_activation(act == "gelu" ? "gelu_new" : act, where);
  return o;
}

T5LayerNormImpl::T5LayerNormImpl(int64_t dim, double eps) : eps(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor T5LayerNormImpl::forward(const at::Tensor& x) {
  const auto variance = x.to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true);
  auto h = x * at::rsqrt(variance + eps);
  if (weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16) h = h.to(weight.scalar_type());
  return weight * h;
}

T5AttentionImpl::T5AttentionImpl(const T5EncoderOptions& o, bool has_relative_attention_bias) : options(o) {
  const int64_t inner = o.num_heads * o.d_kv;
  q = register_module("q", Linear(LinearOptions(o.d_model, inner).bias(false)));
  k = register_module("k", Linear(LinearOptions(o.d_model, inner).bias(false)));
  v = register_module("v", Linear(LinearOptions(o.d_model, inner).bias(false)));
  this->o = register_module("o", Linear(LinearOptions(inner, o.d_model).bias(false)));
  if (has_relative_attention_bias)
    relative_attention_bias =
        register_module("relative_attention_bias", Embedding(o.relative_attention_num_buckets, o.num_heads));
}

at::Tensor T5AttentionImpl::compute_bias(int64_t q_len, int64_t k_len) {
  TORCH_CHECK(!relative_attention_bias.is_empty(), "T5 attention: only the first layer holds the position bias");
  const auto opts = at::TensorOptions().dtype(at::kLong).device(relative_attention_bias->weight.device());
  const auto relative = at::arange(k_len, opts).unsqueeze(0) - at::arange(q_len, opts).unsqueeze(1);
  const auto buckets = relative_position_bucket(relative, options.relative_attention_num_buckets,
                                                options.relative_attention_max_distance);
  return relative_attention_bias->forward(buckets).permute({2, 0, 1}).unsqueeze(0);
}

at::Tensor T5AttentionImpl::forward(const at::Tensor& x, const at::Tensor& bias) {
  // x: [B, T, d_model], bias: [1 or B, heads, T, T] -> [B, T, d_model].
  const int64_t b = x.size(0), t = x.size(1);
  auto heads = [&](Linear& proj) { return proj->forward(x).view({b, t, options.num_heads, options.d_kv}).transpose(1, 2); };
  auto out = at::scaled_dot_product_attention(heads(q), heads(k), heads(v), bias.to(x.scalar_type()), 0.0,
                                              /*is_causal=*/false, /*scale=*/1.0);
  return o->forward(out.transpose(1, 2).reshape({b, t, options.num_heads * options.d_kv}));
}

T5LayerSelfAttentionImpl::T5LayerSelfAttentionImpl(const T5EncoderOptions& o, bool has_relative_attention_bias) {
  SelfAttention = register_module("SelfAttention", T5Attention(o, has_relative_attention_bias));
  layer_norm = register_module("layer_norm", T5LayerNorm(o.d_model, o.layer_norm_epsilon));
}

at::Tensor T5LayerSelfAttentionImpl::forward(const at::Tensor& x, const at::Tensor& bias) {
  return x + SelfAttention->forward(layer_norm->forward(x), bias);
}

T5DenseImpl::T5DenseImpl(const T5EncoderOptions& o) : act(o.activation()) {
  if (o.gated()) {
    wi_0 = register_module("wi_0", Linear(LinearOptions(o.d_model, o.d_ff).bias(false)));
    wi_1 = register_module("wi_1", Linear(LinearOptions(o.d_model, o.d_ff).bias(false)));
  } else {
    wi = register_module("wi", Linear(LinearOptions(o.d_model, o.d_ff).bias(false)));
  }
  wo = register_module("wo", Linear(LinearOptions(o.d_ff, o.d_model).bias(false)));
}

at::Tensor T5DenseImpl::forward(const at::Tensor& x) {
  if (!wi.is_empty()) return wo->forward(activate(act, wi->forward(x)));
  return wo->forward(activate(act, wi_0->forward(x)) * wi_1->forward(x));
}

T5LayerFFImpl::T5LayerFFImpl(const T5EncoderOptions& o) {
  DenseReluDense = register_module("DenseReluDense", T5Dense(o));
  layer_norm = register_module("layer_norm", T5LayerNorm(o.d_model, o.layer_norm_epsilon));
}

at::Tensor T5LayerFFImpl::forward(const at::Tensor& x) { return x + DenseReluDense->forward(layer_norm->forward(x)); }

T5BlockImpl::T5BlockImpl(const T5EncoderOptions& o, bool has_relative_attention_bias) {
  layer = register_module("layer", nn::ModuleList());
  layer->push_back(T5LayerSelfAttention(o, has_relative_attention_bias));
  layer->push_back(T5LayerFF(o));
}

at::Tensor T5BlockImpl::forward(const at::Tensor& x, const at::Tensor& bias) {
  auto h = layer[0]->as<T5LayerSelfAttention>()->forward(x, bias);
  return layer[1]->as<T5LayerFF>()->forward(h);
}

T5StackImpl::T5StackImpl(const T5EncoderOptions& o) {
  block = register_module("block", nn::ModuleList());
  for (int64_t i = 0; i < o.num_layers; ++i) block->push_back(T5Block(o, /*has_relative_attention_bias=*/i == 0));
  final_layer_norm = register_module("final_layer_norm", T5LayerNorm(o.d_model, o.layer_norm_epsilon));
}

T5EncoderImpl::T5EncoderImpl(const T5EncoderOptions& o) : options(o) {
  // The parse errors surface here rather than halfway through building the layers.
  (void)o.gated();
  shared = register_module("shared", Embedding(o.vocab_size, o.d_model));
  encoder = register_module("encoder", T5Stack(o));
}

T5EncoderOutput T5EncoderImpl::forward(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                       bool output_hidden_states) {
  // input_ids: [B, T] int64 (attention_mask [B, T]) -> last_hidden_state [B, T, d_model].
  TORCH_CHECK(input_ids.dim() == 2, "T5 encoder takes [batch, tokens] ids");
  if (shared->weight.scalar_type() == at::kHalf)
    throw Error("the T5 encoder does not run in fp16, where its activations overflow; convert it to bf16 or fp32");
  T5EncoderOutput out;
  auto h = shared->forward(input_ids);
  auto first = encoder->block[0]->as<T5Block>()->layer[0]->as<T5LayerSelfAttention>()->SelfAttention;
  auto bias = first->compute_bias(input_ids.size(1), input_ids.size(1));
  if (attention_mask.defined()) {
    const auto masked = attention_mask.eq(0).view({attention_mask.size(0), 1, 1, attention_mask.size(1)});
    // The dtype's own lowest value, as transformers masks (fp32's would round to -inf in bf16).
    const double lowest = bias.scalar_type() == at::kBFloat16
                              ? static_cast<double>(std::numeric_limits<c10::BFloat16>::lowest())
                              : static_cast<double>(std::numeric_limits<float>::lowest());
    bias = bias.masked_fill(masked, lowest);
  }
  if (output_hidden_states) out.hidden_states.push_back(h);
  for (const auto& block : *encoder->block) {
    h = block->as<T5Block>()->forward(h, bias);
    if (output_hidden_states) out.hidden_states.push_back(h);
  }
  out.last_hidden_state = encoder->final_layer_norm->forward(h);
  return out;
}

T5Encoder load_t5_encoder(const std::filesystem::path& dir, const std::string& variant) {
  const auto options = T5EncoderOptions::from_json(dir / "config.json");
  const auto weights = io::require_weights(dir, variant);
  T5Encoder model(options);
  model->eval();
  io::bind(*model, io::map_t5_encoder_keys(io::load_state_dict(weights)), weights.string());
  log::get("models").debug(log::str(dir.string(), ": T5 encoder, ", options.num_layers, " layers, d_model ",
                                    options.d_model, ", ", options.feed_forward_proj));
  return model;
}

}  // namespace diffract::models
