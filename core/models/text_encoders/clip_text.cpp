#include "core/models/text_encoders/clip_text.h"

#include <ATen/ATen.h>

#include "core/io/diffusers_folder.h"
#include "core/io/json_file.h"
#include "core/io/key_maps.h"
#include "core/io/weights.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace diffract::models {

namespace nn = torch::nn;

CLIPTextConfig CLIPTextConfig::clip_l() { return {}; }

CLIPTextConfig CLIPTextConfig::open_clip_h() {
  CLIPTextConfig c;
  c.hidden_size = 1024;
  c.intermediate_size = 4096;
  c.projection_dim = 1024;
  c.num_hidden_layers = 23;
  c.num_attention_heads = 16;
  c.hidden_act = "gelu";
  return c;
}

CLIPTextConfig CLIPTextConfig::open_clip_bigg() {
  CLIPTextConfig c;
  c.hidden_size = 1280;
  c.intermediate_size = 5120;
  c.projection_dim = 1280;
  c.num_hidden_layers = 32;
  c.num_attention_heads = 20;
  c.hidden_act = "gelu";
  return c;
}

CLIPTextConfig CLIPTextConfig::from_json(const std::filesystem::path& path) {
  const auto j = io::JsonFile::read(path);
  CLIPTextConfig c;  // transformers' class defaults differ from CLIP-L only where noted below
  c.hidden_size = j.required<int64_t>("hidden_size");
  c.intermediate_size = j.required<int64_t>("intermediate_size");
  c.num_hidden_layers = j.required<int64_t>("num_hidden_layers");
  c.num_attention_heads = j.required<int64_t>("num_attention_heads");
  c.vocab_size = j.optional<int64_t>("vocab_size", 49408);
  c.projection_dim = j.optional<int64_t>("projection_dim", 512);
  c.max_position_embeddings = j.optional<int64_t>("max_position_embeddings", 77);
  c.hidden_act = j.optional<std::string>("hidden_act", "quick_gelu");
  c.layer_norm_eps = j.optional<double>("layer_norm_eps", 1e-5);
  c.eos_token_id = j.optional<int64_t>("eos_token_id", 2);
  const std::string where = path.string();
  parse_activation(c.hidden_act, where);
  for (auto [name, v] : {std::pair{"hidden_size", c.hidden_size}, {"intermediate_size", c.intermediate_size},
                         {"num_hidden_layers", c.num_hidden_layers}, {"num_attention_heads", c.num_attention_heads},
                         {"vocab_size", c.vocab_size}, {"max_position_embeddings", c.max_position_embeddings}})
    if (v <= 0) throw Error(where + ": '" + name + "' must be positive, got " + std::to_string(v));
  if (c.hidden_size % c.num_attention_heads != 0)
    throw Error(where + ": hidden_size " + std::to_string(c.hidden_size) + " is not divisible by num_attention_heads " +
                std::to_string(c.num_attention_heads));
  return c;
}

CLIPTextEmbeddingsImpl::CLIPTextEmbeddingsImpl(const CLIPTextConfig& c) {
  token_embedding = register_module("token_embedding", Embedding(c.vocab_size, c.hidden_size));
  position_embedding = register_module("position_embedding", Embedding(c.max_position_embeddings, c.hidden_size));
}

at::Tensor CLIPTextEmbeddingsImpl::forward(const at::Tensor& input_ids) {
  const auto t = input_ids.size(1);
  auto positions = at::arange(t, input_ids.options().dtype(at::kLong));
  return token_embedding->forward(input_ids) + position_embedding->forward(positions).unsqueeze(0);
}

CLIPAttentionImpl::CLIPAttentionImpl(const CLIPTextConfig& c) : heads(c.num_attention_heads) {
  k_proj = register_module("k_proj", Linear(c.hidden_size, c.hidden_size));
  v_proj = register_module("v_proj", Linear(c.hidden_size, c.hidden_size));
  q_proj = register_module("q_proj", Linear(c.hidden_size, c.hidden_size));
  out_proj = register_module("out_proj", Linear(c.hidden_size, c.hidden_size));
}

at::Tensor CLIPAttentionImpl::forward(const at::Tensor& x) {
  // x: [B, T, C] -> [B, T, C], causal.
  auto h = multi_head_attention(q_proj->forward(x), k_proj->forward(x), v_proj->forward(x), heads, /*causal=*/true);
  return out_proj->forward(h);
}

CLIPMLPImpl::CLIPMLPImpl(const CLIPTextConfig& c) : act(parse_activation(c.hidden_act, "CLIP text config")) {
  fc1 = register_module("fc1", Linear(c.hidden_size, c.intermediate_size));
  fc2 = register_module("fc2", Linear(c.intermediate_size, c.hidden_size));
}

at::Tensor CLIPMLPImpl::forward(const at::Tensor& x) { return fc2->forward(apply_activation(act, fc1->forward(x))); }

CLIPEncoderLayerImpl::CLIPEncoderLayerImpl(const CLIPTextConfig& c) {
  auto ln = [&] { return nn::LayerNorm(nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)); };
  self_attn = register_module("self_attn", CLIPAttention(c));
  layer_norm1 = register_module("layer_norm1", ln());
  mlp = register_module("mlp", CLIPMLP(c));
  layer_norm2 = register_module("layer_norm2", ln());
}

at::Tensor CLIPEncoderLayerImpl::forward(const at::Tensor& x) {
  auto h = x + self_attn->forward(layer_norm1->forward(x));
  return h + mlp->forward(layer_norm2->forward(h));
}

CLIPEncoderImpl::CLIPEncoderImpl(const CLIPTextConfig& c) {
  layers = register_module("layers", nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(CLIPEncoderLayer(c));
}

CLIPTextTransformerImpl::CLIPTextTransformerImpl(const CLIPTextConfig& c) : config(c) {
  embeddings = register_module("embeddings", CLIPTextEmbeddings(c));
  encoder = register_module("encoder", CLIPEncoder(c));
  final_layer_norm =
      register_module("final_layer_norm", nn::LayerNorm(nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)));
}

CLIPTextOutput CLIPTextTransformerImpl::forward(const at::Tensor& input_ids, bool output_hidden_states) {
  // input_ids: [B, T] -> last_hidden_state [B, T, C], pooled [B, C].
  TORCH_CHECK(input_ids.dim() == 2, "CLIP text model takes [batch, tokens] ids");
  TORCH_CHECK(input_ids.size(1) <= config.max_position_embeddings, "CLIP text model: ", input_ids.size(1),
              " tokens exceed max_position_embeddings ", config.max_position_embeddings);
  CLIPTextOutput out;
  auto h = embeddings->forward(input_ids);
  if (output_hidden_states) out.hidden_states.push_back(h);
  for (const auto& layer : *encoder->layers) {
    h = layer->as<CLIPEncoderLayer>()->forward(h);
    if (output_hidden_states) out.hidden_states.push_back(h);
  }
  out.last_hidden_state = final_layer_norm->forward(h);
  // Older configs carry eos_token_id 2 while the real EOS is the highest id in the vocabulary.
  const auto eos_pos = config.eos_token_id == 2 ? input_ids.argmax(-1)
                                                : input_ids.eq(config.eos_token_id).to(at::kInt).argmax(-1);
  const auto rows = at::arange(input_ids.size(0), input_ids.options().dtype(at::kLong));
  out.pooled = out.last_hidden_state.index({rows, eos_pos});
  return out;
}

CLIPTextModelImpl::CLIPTextModelImpl(const CLIPTextConfig& c) {
  text_model = register_module("text_model", CLIPTextTransformer(c));
}

CLIPTextOutput CLIPTextModelImpl::forward(const at::Tensor& input_ids, bool output_hidden_states) {
  return text_model->forward(input_ids, output_hidden_states);
}

CLIPTextModelWithProjectionImpl::CLIPTextModelWithProjectionImpl(const CLIPTextConfig& c) {
  text_model = register_module("text_model", CLIPTextTransformer(c));
  text_projection = register_module("text_projection",
                                    Linear(LinearOptions(c.hidden_size, c.projection_dim).bias(false)));
}

CLIPTextOutput CLIPTextModelWithProjectionImpl::forward(const at::Tensor& input_ids, bool output_hidden_states) {
  auto out = text_model->forward(input_ids, output_hidden_states);
  out.text_embeds = text_projection->forward(out.pooled);
  return out;
}

namespace {

template <typename Model>
Model load(const std::filesystem::path& dir, const std::string& variant) {
  const auto config = CLIPTextConfig::from_json(dir / "config.json");
  const auto weights = io::require_weights(dir, variant);
  Model model(config);
  model->eval();
  io::BindOptions options;
  options.ignore_unexpected = {"text_model.embeddings.position_ids"};  // a non-persistent buffer in older exports
  io::bind(*model, io::map_clip_text_keys(io::load_state_dict(weights)), weights.string(), options);
  log::get("models").debug(log::str(dir.string(), ": CLIP text model, ", config.num_hidden_layers, " layers, hidden ",
                                    config.hidden_size));
  return model;
}

}  // namespace

CLIPTextModel load_clip_text_model(const std::filesystem::path& dir, const std::string& variant) {
  return load<CLIPTextModel>(dir, variant);
}

CLIPTextModelWithProjection load_clip_text_model_with_projection(const std::filesystem::path& dir,
                                                                 const std::string& variant) {
  return load<CLIPTextModelWithProjection>(dir, variant);
}

}  // namespace diffract::models
