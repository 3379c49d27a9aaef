#include "core/pipeline/single_file.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <set>

#include "core/io/diffusers_folder.h"
#include "core/io/json_file.h"
#include "core/io/safetensors.h"
#include "core/io/upload.h"
#include "core/io/weights.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace diffract::pipeline {

namespace fs = std::filesystem;
using io::SingleFileFamily;
using io::StateDict;

namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Reads shapes of one component's state dict; errors name the component and the key.
class Shapes {
 public:
  Shapes(const StateDict& sd, std::string what) : sd_(sd), what_(std::move(what)) {}

  bool has(const std::string& key) const { return sd_.count(key) > 0; }
  std::vector<int64_t> shape(const std::string& key) const {
    auto it = sd_.find(key);
    if (it == sd_.end()) throw Error(what_ + ": no tensor '" + key + "'");
    return it->second.sizes().vec();
  }
  int64_t dim(const std::string& key, std::size_t d) const {
    const auto s = shape(key);
    if (d >= s.size()) throw Error(what_ + ": '" + key + "' has " + std::to_string(s.size()) + " dimensions");
    return s[d];
  }
  // How many consecutive "head.N." exist, from 0.
  int64_t count(const std::string& head) const {
    std::set<int64_t> seen;
    for (auto it = sd_.lower_bound(head); it != sd_.end() && starts_with(it->first, head); ++it) {
      const std::string rest = it->first.substr(head.size());
      std::size_t digits = 0;
      while (digits < rest.size() && std::isdigit(static_cast<unsigned char>(rest[digits]))) ++digits;
      if (digits > 0 && digits < 10 && digits < rest.size() && rest[digits] == '.')
        seen.insert(std::stoll(rest.substr(0, digits)));
    }
    int64_t n = 0;
    while (seen.count(n)) ++n;
    if (n != static_cast<int64_t>(seen.size()))
      throw Error(what_ + ": '" + head + "N' indices are not consecutive from 0");
    return n;
  }
  [[noreturn]] void fail(const std::string& why) const { throw Error(what_ + ": " + why); }

 private:
  const StateDict& sd_;
  std::string what_;
};

const char* kNeedConfig = "; give a diffusers config folder (config_dir) for this model";

int64_t heads_by_convention(int64_t channels, int64_t head_width, const Shapes& s, const std::string& where) {
  if (channels % head_width != 0)
    s.fail("cannot infer the attention heads of " + where + ": " + std::to_string(channels) +
           " channels are not a multiple of the " + std::to_string(head_width) + "-wide heads the family uses" +
           kNeedConfig);
  return channels / head_width;
}

void check_groups(const std::vector<int64_t>& channels, int64_t groups, const Shapes& s) {
  for (auto ch : channels)
    if (ch % groups != 0)
      s.fail(std::to_string(ch) + " channels are not divisible into the " + std::to_string(groups) +
             " norm groups SD models use" + kNeedConfig);
}

std::optional<fs::path> component_config(const SingleFileOptions& options, const std::string& name) {
  if (options.config_dir.empty()) return std::nullopt;
  const auto p = options.config_dir / name / "config.json";
  if (fs::exists(p)) return p;
  return std::nullopt;
}

// config_dir's scheduler/scheduler_config.json, when there is one.
std::optional<fs::path> scheduler_config(const SingleFileOptions& options) {
  if (options.config_dir.empty()) return std::nullopt;
  const auto p = options.config_dir / "scheduler" / "scheduler_config.json";
  if (fs::exists(p)) return p;
  return std::nullopt;
}

// A whole component of config_dir (config.json and weights), for what a single file lacks.
std::optional<fs::path> config_component(const SingleFileOptions& options, const std::string& name) {
  if (options.config_dir.empty()) return std::nullopt;
  const auto dir = options.config_dir / name;
  if (!fs::is_regular_file(dir / "config.json")) return std::nullopt;
  if (io::find_weights(dir, "") || io::find_weights(dir, "fp16")) return dir;
  return std::nullopt;
}
const char* folder_variant(const fs::path& dir) { return io::find_weights(dir, "") ? "" : "fp16"; }

// A single file's tensors (views of the mapping for .safetensors) and their shapes, read from the
// header alone for .safetensors.
StateDict read_single_file(const fs::path& file, std::vector<io::TensorShape>& shapes) {
  StateDict all;
  if (ends_with(file.filename().string(), ".safetensors")) {
    std::shared_ptr<const io::SafetensorsArchive> archive = io::SafetensorsArchive::open(file);
    shapes = io::tensor_shapes(*archive);
    for (const auto& t : archive->tensors()) all.emplace(t.name, io::to_tensor(archive, t));
  } else {
    all = io::load_state_dict(file);
    shapes = io::tensor_shapes(all);
  }
  return all;
}

// "a, b and c"
std::string listing(const std::vector<std::string>& items) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) out += (i ? (i + 1 == items.size() ? " and " : ", ") : "") + items[i];
  return out;
}

// What a loader took from config_dir, for its log line: ", configs from DIR, from the config folder: a and b".
std::string config_dir_summary(const SingleFileOptions& options, const std::vector<std::string>& configured,
                               const std::vector<std::string>& from_config_dir) {
  std::string out;
  if (!configured.empty()) out += ", configs from " + options.config_dir.string();
  if (!from_config_dir.empty()) out += ", from the config folder: " + listing(from_config_dir);
  return out;
}

// Resblock count of an OpenCLIP encoder under `prefix`.
int64_t open_clip_blocks(const StateDict& all, const std::string& prefix, const std::string& what) {
  StateDict blocks;
  const std::string head = prefix + "transformer.resblocks.";
  for (auto it = all.lower_bound(head); it != all.end() && starts_with(it->first, head); ++it)
    blocks.emplace(it->first, it->second);
  return Shapes(blocks, what).count(head);
}

template <typename Model>
void bind_strict(Model& model, const StateDict& weights, const std::string& what) {
  model->eval();
  io::bind(*model, weights, what);
}

}  // namespace

// --- shape inference ---------------------------------------------------------------------------

models::UNet2DConditionConfig infer_unet_config(const StateDict& unet, SingleFileFamily family,
                                                int64_t pooled_text_dim, const std::string& what, bool encoder_only) {
  const Shapes s(unet, what);
  models::UNet2DConditionConfig c;
  c.in_channels = s.dim("conv_in.weight", 1);
  c.out_channels = encoder_only ? c.in_channels : s.dim("conv_out.weight", 0);
  c.sample_size = family == SingleFileFamily::SDXL ? 128 : family == SingleFileFamily::SD2 ? 96 : 64;
  const int64_t n = s.count("down_blocks.");
  if (n == 0) s.fail("no down_blocks");
  if (!encoder_only && s.count("up_blocks.") != n)
    s.fail(std::to_string(n) + " down blocks but " + std::to_string(s.count("up_blocks.")) + " up blocks");

  // One attention block's facts: depth, context width, projection kind.
  struct Attn {
    int64_t depth = 0, context = 0;
    bool linear = false;
  };
  const auto attention = [&](const std::string& head) {
    Attn a;
    a.depth = s.count(head + "transformer_blocks.");
    if (a.depth == 0) s.fail("'" + head + "' has no transformer_blocks");
    a.context = s.dim(head + "transformer_blocks.0.attn2.to_k.weight", 1);
    a.linear = s.shape(head + "proj_in.weight").size() == 2;
    return a;
  };
  const Attn mid = attention("mid_block.attentions.0.");
  c.use_linear_projection = mid.linear;
  const auto check_attn = [&](const Attn& a, const std::string& head) {
    if (a.linear != mid.linear) s.fail("'" + head + "' mixes linear and convolutional projections (not supported)");
  };

  std::vector<int64_t> down_depth(n, 0);
  for (int64_t b = 0; b < n; ++b) {
    const std::string head = "down_blocks." + std::to_string(b) + ".";
    const int64_t layers = s.count(head + "resnets.");
    const int64_t attns = s.count(head + "attentions.");
    if (layers == 0) s.fail("'" + head + "' has no resnets");
    if (attns != 0 && attns != layers)
      s.fail("'" + head + "' has " + std::to_string(layers) + " resnets but " + std::to_string(attns) + " attentions");
    c.block_out_channels.push_back(s.dim(head + "resnets.0.conv1.weight", 0));
    c.layers_per_block.push_back(layers);
    c.down_block_types.push_back(attns ? "CrossAttnDownBlock2D" : "DownBlock2D");
    int64_t context = mid.context;
    for (int64_t l = 0; l < attns; ++l) {
      const std::string ah = head + "attentions." + std::to_string(l) + ".";
      const Attn a = attention(ah);
      check_attn(a, ah);
      if (l > 0 && (a.depth != down_depth[b] || a.context != context))
        s.fail("'" + head + "' has attentions of different depth or context width (not supported)");
      down_depth[b] = a.depth;
      context = a.context;
    }
    c.cross_attention_dim.push_back(context);
    c.transformer_layers_per_block.push_back(attns ? down_depth[b] : 1);
  }
  // The mid block takes the last block's depth in this model (as in diffusers' SD configs); a last
  // block without attention leaves that entry free for it.
  if (down_depth.back() == 0) c.transformer_layers_per_block.back() = mid.depth;
  else if (down_depth.back() != mid.depth)
    s.fail("the mid block's transformer depth " + std::to_string(mid.depth) + " differs from the last down block's " +
           std::to_string(down_depth.back()) + " (not supported)");
  if (c.cross_attention_dim.back() != mid.context)
    s.fail("the mid block's context width differs from the last down block's (not supported)");

  for (int64_t b = 0; encoder_only && b < n; ++b) {  // the up blocks mirror the encoder (a ControlNet has none)
    const auto rev = static_cast<std::size_t>(n - 1 - b);
    c.up_block_types.push_back(c.down_block_types[rev] == "CrossAttnDownBlock2D" ? "CrossAttnUpBlock2D" : "UpBlock2D");
    c.reverse_transformer_layers_per_block.push_back(c.transformer_layers_per_block[rev]);
  }
  for (int64_t b = 0; !encoder_only && b < n; ++b) {
    const std::string head = "up_blocks." + std::to_string(b) + ".";
    const auto rev = static_cast<std::size_t>(n - 1 - b);
    const int64_t layers = s.count(head + "resnets.");
    const int64_t attns = s.count(head + "attentions.");
    if (layers != c.layers_per_block[rev] + 1)
      s.fail("'" + head + "' has " + std::to_string(layers) + " resnets where its down block's " +
             std::to_string(c.layers_per_block[rev]) + " + 1 were expected");
    if (attns != 0 && attns != layers)
      s.fail("'" + head + "' has " + std::to_string(layers) + " resnets but " + std::to_string(attns) + " attentions");
    c.up_block_types.push_back(attns ? "CrossAttnUpBlock2D" : "UpBlock2D");
    int64_t depth = 0;
    for (int64_t l = 0; l < attns; ++l) {
      const std::string ah = head + "attentions." + std::to_string(l) + ".";
      const Attn a = attention(ah);
      check_attn(a, ah);
      if ((l > 0 && a.depth != depth) || a.context != c.cross_attention_dim[rev])
        s.fail("'" + head + "' has attentions of different depth or context width (not supported)");
      depth = a.depth;
    }
    c.reverse_transformer_layers_per_block.push_back(attns ? depth : c.transformer_layers_per_block[rev]);
  }

  for (auto ch : c.block_out_channels) {
    const std::string where = std::to_string(ch) + "-channel blocks";
    c.num_attention_heads.push_back(family == SingleFileFamily::SD1 ? 8 : heads_by_convention(ch, 64, s, where));
    if (ch % c.num_attention_heads.back() != 0)
      s.fail(std::to_string(ch) + " channels are not divisible into SD 1.x's 8 attention heads" + kNeedConfig);
  }
  c.norm_num_groups = 32;
  check_groups(c.block_out_channels, c.norm_num_groups, s);

  if (s.has("add_embedding.linear_1.weight")) {
    c.addition_embed_type = "text_time";
    c.projection_class_embeddings_input_dim = s.dim("add_embedding.linear_1.weight", 1);
    const int64_t times = c.projection_class_embeddings_input_dim - pooled_text_dim;
    if (pooled_text_dim <= 0 || times <= 0 || times % 6 != 0)
      s.fail("the added conditioning takes " + std::to_string(c.projection_class_embeddings_input_dim) +
             " features, which is not the pooled text width " + std::to_string(pooled_text_dim) +
             " plus 6 time-id embeddings");
    c.addition_time_embed_dim = times / 6;
  }
  return c;
}

models::ControlNetModel load_controlnet_file(const fs::path& file) {
  const std::string what = file.string();
  auto weights = io::load_state_dict(file);
  std::string layout = "diffusers";
  if (!weights.count("controlnet_cond_embedding.conv_in.weight")) {
    if (!io::is_ldm_controlnet(weights))
      throw Error(what + ": not a ControlNet (no controlnet_cond_embedding.conv_in.weight, zero_convs or input_hint_block)");
    // ControlNet 1.0's "diff" files hold the difference to their base model, which A1111 adds back.
    if (weights.count("difference") || weights.count("control_model.difference"))
      throw Error(what + ": a difference ControlNet (weights relative to the model it was trained from), not "
                         "supported: use its full version");
    std::size_t dropped = 0;
    try {
      weights = io::map_ldm_controlnet(weights, &dropped);
    } catch (const Error& e) {
      throw Error(what + ": " + e.what());
    }
    layout = "original (lllyasviel)";
    if (dropped)
      log::get("pipeline").info(log::str(what, ": ", dropped, " tensors of a bundled base model left unused"));
  }
  const Shapes s(weights, what);
  // The family decides the attention heads: SDXL (added embeddings) and SD 2.x (1024-wide
  // context) use 64-wide heads, SD 1.x eight heads.
  const bool xl = s.has("add_embedding.linear_1.weight");
  int64_t context = 0;
  for (const auto& [key, t] : weights)
    if (ends_with(key, "attn2.to_k.weight")) {
      context = t.size(1);
      break;
    }
  const auto family = xl ? SingleFileFamily::SDXL : context == 1024 ? SingleFileFamily::SD2 : SingleFileFamily::SD1;
  models::ControlNetConfig c;
  c.unet = infer_unet_config(weights, family, xl ? 1280 : 0, what, /*encoder_only=*/true);
  c.conditioning_channels = s.dim("controlnet_cond_embedding.conv_in.weight", 1);
  c.conditioning_embedding_out_channels = {s.dim("controlnet_cond_embedding.conv_in.weight", 0)};
  const int64_t blocks = s.count("controlnet_cond_embedding.blocks.");
  if (blocks % 2 != 0) s.fail("controlnet_cond_embedding has an odd number of blocks (" + std::to_string(blocks) + ")");
  for (int64_t i = 1; i < blocks; i += 2)
    c.conditioning_embedding_out_channels.push_back(
        s.dim("controlnet_cond_embedding.blocks." + std::to_string(i) + ".weight", 0));
  models::ControlNetModel net(c);
  bind_strict(net, weights, what);
  log::get("pipeline").info(log::str(what, ": a ControlNet in the ", layout, " layout (", io::single_file_family_name(family),
                                     ", config from its shapes)"));
  return net;
}

models::AutoencoderKLConfig infer_vae_config(const StateDict& vae, SingleFileFamily family, const std::string& what) {
  const Shapes s(vae, what);
  auto c = family == SingleFileFamily::SDXL ? models::AutoencoderKLConfig::sdxl() : models::AutoencoderKLConfig::sd();
  if (family == SingleFileFamily::SD2) c.sample_size = 768;
  const int64_t n = s.count("encoder.down_blocks.");
  if (n == 0) s.fail("no encoder.down_blocks");
  if (s.count("decoder.up_blocks.") != n)
    s.fail(std::to_string(n) + " encoder blocks but " + std::to_string(s.count("decoder.up_blocks.")) + " decoder blocks");
  c.block_out_channels.clear();
  c.layers_per_block = s.count("encoder.down_blocks.0.resnets.");
  for (int64_t b = 0; b < n; ++b) {
    const std::string down = "encoder.down_blocks." + std::to_string(b) + ".";
    const std::string up = "decoder.up_blocks." + std::to_string(b) + ".";
    if (s.count(down + "resnets.") != c.layers_per_block || s.count(up + "resnets.") != c.layers_per_block + 1)
      s.fail("blocks with different resnet counts are not an AutoencoderKL (expected " +
             std::to_string(c.layers_per_block) + " per encoder block and one more per decoder block)");
    c.block_out_channels.push_back(s.dim(down + "resnets.0.conv1.weight", 0));
  }
  c.down_block_types.assign(static_cast<std::size_t>(n), "DownEncoderBlock2D");
  c.up_block_types.assign(static_cast<std::size_t>(n), "UpDecoderBlock2D");
  c.in_channels = s.dim("encoder.conv_in.weight", 1);
  c.out_channels = s.dim("decoder.conv_out.weight", 0);
  c.latent_channels = s.dim("decoder.conv_in.weight", 1);
  c.use_quant_conv = s.has("quant_conv.weight");
  c.use_post_quant_conv = s.has("post_quant_conv.weight");
  c.mid_block_add_attention = s.has("encoder.mid_block.attentions.0.to_q.weight");
  c.norm_num_groups = 32;
  check_groups(c.block_out_channels, c.norm_num_groups, s);
  return c;
}

models::CLIPTextConfig infer_clip_text_config(const StateDict& text_encoder, const std::string& hidden_act,
                                              const std::string& what) {
  const Shapes s(text_encoder, what);
  models::CLIPTextConfig c;
  c.vocab_size = s.dim("text_model.embeddings.token_embedding.weight", 0);
  c.hidden_size = s.dim("text_model.embeddings.token_embedding.weight", 1);
  c.max_position_embeddings = s.dim("text_model.embeddings.position_embedding.weight", 0);
  c.num_hidden_layers = s.count("text_model.encoder.layers.");
  if (c.num_hidden_layers == 0) s.fail("no text_model.encoder.layers");
  c.intermediate_size = s.dim("text_model.encoder.layers.0.mlp.fc1.weight", 0);
  c.num_attention_heads = heads_by_convention(c.hidden_size, 64, s, "the text encoder");
  c.hidden_act = hidden_act;
  c.projection_dim = s.has("text_projection.weight") ? s.dim("text_projection.weight", 0) : c.hidden_size;
  c.eos_token_id = 2;  // legacy: pooled at the highest id, which is the end token
  return c;
}

// --- loading -----------------------------------------------------------------------------------

SingleFileModels load_single_file(const fs::path& file, const SingleFileOptions& options) {
  const std::string what = file.string();
  if (!fs::is_regular_file(file)) throw Error(what + ": no such checkpoint file");
  if (!options.config_dir.empty() && !fs::is_directory(options.config_dir))
    throw Error(options.config_dir.string() + ": config folder for " + what + " does not exist");

  StateDict all;
  io::SingleFileLayout layout;
  if (ends_with(file.filename().string(), ".safetensors")) {
    std::shared_ptr<const io::SafetensorsArchive> archive = io::SafetensorsArchive::open(file);
    layout = io::detect_single_file(*archive);  // header only: nothing is read before the family is known
    for (const auto& t : archive->tensors()) all.emplace(t.name, io::to_tensor(archive, t));
  } else {
    all = io::load_state_dict(file);
    layout = io::detect_single_file(io::tensor_shapes(all), what);
  }

  SingleFileModels m;
  m.path = file;
  m.family = layout.family;
  const auto part = [&](const std::string& name, const std::string& prefix) {
    return what + " (" + name + " at " + prefix + "*)";
  };

  // Text encoders first: SDXL's UNet config needs the pooled width.
  {
    const std::string where = part("text_encoder", layout.text_encoder_prefix);
    const auto json = component_config(options, "text_encoder");
    StateDict te;
    models::CLIPTextConfig config;
    if (layout.text_encoder_open_clip) {
      int64_t keep = layout.open_clip_blocks - 1;  // SD 2.x takes the penultimate layer: the last is unused
      if (json) keep = models::CLIPTextConfig::from_json(*json).num_hidden_layers;
      te = io::map_open_clip(all, layout.text_encoder_prefix, keep, /*with_projection=*/false);
      config = json ? models::CLIPTextConfig::from_json(*json) : infer_clip_text_config(te, "gelu", where);
    } else {
      te = io::map_sd_clip(all, layout.text_encoder_prefix);
      config = json ? models::CLIPTextConfig::from_json(*json) : infer_clip_text_config(te, "quick_gelu", where);
    }
    if (json) m.configured.push_back("text_encoder");
    m.text_encoder = models::CLIPTextModel(config);
    bind_strict(m.text_encoder, te, where);
    m.tokenizer.max_length = static_cast<int>(config.max_position_embeddings);
    if (layout.family == SingleFileFamily::SD2) m.tokenizer.pad_token = "!";
  }
  int64_t pooled_dim = 0;
  if (layout.family == SingleFileFamily::SDXL) {
    const std::string where = part("text_encoder_2", layout.text_encoder_2_prefix);
    const auto json = component_config(options, "text_encoder_2");
    auto te = io::map_open_clip(all, layout.text_encoder_2_prefix, -1, /*with_projection=*/true);
    const auto config = json ? models::CLIPTextConfig::from_json(*json) : infer_clip_text_config(te, "gelu", where);
    if (json) m.configured.push_back("text_encoder_2");
    m.text_encoder_2 = models::CLIPTextModelWithProjection(config);
    bind_strict(m.text_encoder_2, te, where);
    pooled_dim = config.projection_dim;
    text::CLIPTokenizerOptions tok;
    tok.pad_token = "!";
    tok.max_length = static_cast<int>(config.max_position_embeddings);
    m.tokenizer_2 = tok;
  }
  {
    const std::string where = part("unet", layout.unet_prefix);
    const auto json = component_config(options, "unet");
    auto unet = io::map_ldm_unet(all, layout.unet_prefix);
    const auto config = json ? models::UNet2DConditionConfig::from_json(*json)
                             : infer_unet_config(unet, layout.family, pooled_dim, where);
    if (json) m.configured.push_back("unet");
    m.unet = models::UNet2DConditionModel(config);
    bind_strict(m.unet, unet, where);
  }
  {
    const std::string where = part("vae", layout.vae_prefix);
    const auto json = component_config(options, "vae");
    auto vae = io::map_ldm_vae(all, layout.vae_prefix);
    const auto config = json ? models::AutoencoderKLConfig::from_json(*json) : infer_vae_config(vae, layout.family, where);
    if (json) m.configured.push_back("vae");
    m.vae = models::AutoencoderKL(config);
    bind_strict(m.vae, vae, where);
  }

  m.prediction_type = layout.v_prediction_hint || layout.family == SingleFileFamily::SD2 ? "v_prediction" : "epsilon";
  if (const auto sched = scheduler_config(options)) {
    m.prediction_type = io::JsonFile::read(*sched).optional<std::string>("prediction_type", "epsilon");
    m.configured.push_back("scheduler");
  }
  log::get("pipeline").info(log::str(what, ": ", io::single_file_family_name(m.family), " single file, ",
                                     all.size(), " tensors, prediction ", m.prediction_type,
                                     m.configured.empty() ? "" : ", configs from " + options.config_dir.string()));
  return m;
}

// --- SD3 / SD3.5 ---------------------------------------------------------------------------------

namespace {

// The 16-channel VAE of an SD3 / FLUX single file, under `prefix` (LDM keys), its config from
// config_dir's vae/ or inferred with `conventions`' scaling, shift and sample size; without one in
// the file (empty prefix), config_dir's whole vae/ component. Names what it took in `configured` /
// `from_config_dir`.
models::AutoencoderKL load_latent_vae(const StateDict& all, const std::string& prefix, const SingleFileOptions& options,
                                      const models::AutoencoderKLConfig& conventions, const std::string& where,
                                      std::vector<std::string>& configured, std::vector<std::string>& from_config_dir) {
  if (prefix.empty()) {
    const auto dir = config_component(options, "vae");
    if (!dir) throw Error(where + ": no VAE in the file or the config folder");
    from_config_dir.push_back("vae");
    return models::load_autoencoder_kl(*dir, folder_variant(*dir));
  }
  const auto json = component_config(options, "vae");
  auto vae = io::map_ldm_vae(all, prefix);
  models::AutoencoderKLConfig config;
  if (json) {
    config = models::AutoencoderKLConfig::from_json(*json);
    configured.push_back("vae");
  } else {
    config = infer_vae_config(vae, SingleFileFamily::SDXL, where);
    config.scaling_factor = conventions.scaling_factor;
    config.shift_factor = conventions.shift_factor;
    config.sample_size = conventions.sample_size;
  }
  models::AutoencoderKL model(config);
  bind_strict(model, vae, where);
  return model;
}

}  // namespace


models::T5EncoderOptions infer_t5_config(const StateDict& t5, const std::string& what) {
  const Shapes s(t5, what);
  models::T5EncoderOptions o;
  o.vocab_size = s.dim("shared.weight", 0);
  o.d_model = s.dim("shared.weight", 1);
  o.num_layers = s.count("encoder.block.");
  if (o.num_layers == 0) s.fail("no encoder.block.*");
  const std::string attn = "encoder.block.0.layer.0.SelfAttention.";
  o.relative_attention_num_buckets = s.dim(attn + "relative_attention_bias.weight", 0);
  o.num_heads = s.dim(attn + "relative_attention_bias.weight", 1);
  const int64_t inner = s.dim(attn + "q.weight", 0);
  if (o.num_heads <= 0 || inner % o.num_heads != 0)
    s.fail("the attention's " + std::to_string(inner) + " features do not split into the relative-position table's " +
           std::to_string(o.num_heads) + " heads");
  o.d_kv = inner / o.num_heads;
  const std::string ff = "encoder.block.0.layer.1.DenseReluDense.";
  if (s.has(ff + "wi_0.weight")) {
    o.feed_forward_proj = "gated-gelu";  // T5 v1.1 (SD3's t5xxl)
    o.d_ff = s.dim(ff + "wi_0.weight", 0);
  } else {
    o.feed_forward_proj = "relu";
    o.d_ff = s.dim(ff + "wi.weight", 0);
  }
  return o;
}

bool is_sd3_single_file(const fs::path& file) {
  std::error_code ec;
  if (!ends_with(file.filename().string(), ".safetensors") || !fs::is_regular_file(file, ec)) return false;
  try {
    return io::is_sd3_single_file(io::tensor_shapes(*io::SafetensorsArchive::open(file)));
  } catch (const Error&) {
    return false;  // unreadable: the SD loader reports it
  }
}

SD3SingleFileModels load_sd3_single_file(const fs::path& file, const SingleFileOptions& options, bool load_t5) {
  const std::string what = file.string();
  if (!fs::is_regular_file(file)) throw Error(what + ": no such checkpoint file");
  if (!options.config_dir.empty() && !fs::is_directory(options.config_dir))
    throw Error(options.config_dir.string() + ": config folder for " + what + " does not exist");

  SD3SingleFileModels m;
  m.path = file;
  std::vector<io::TensorShape> shapes;
  const StateDict all = read_single_file(file, shapes);
  m.layout = io::detect_sd3_single_file(shapes, what);
  const auto& layout = m.layout;
  const auto part = [&](const std::string& name, const std::string& prefix) {
    return what + " (" + name + " at " + prefix + "*)";
  };
  const auto folder_component = [&](const std::string& name) { return config_component(options, name); };

  {
    std::vector<std::string> missing;
    if (layout.vae_prefix.empty() && !folder_component("vae")) missing.push_back("the VAE (first_stage_model.*)");
    if (layout.clip_l_prefix.empty() && !folder_component("text_encoder"))
      missing.push_back("the CLIP-L text encoder (text_encoders.clip_l.transformer.*)");
    if (layout.clip_g_prefix.empty() && !folder_component("text_encoder_2"))
      missing.push_back("the CLIP-G text encoder (text_encoders.clip_g.transformer.*)");
    if (!missing.empty()) {
      std::string msg = what + ": incomplete " + layout.variant + " single file: it lacks " + listing(missing);
      msg += ". Give a diffusers SD3 folder holding " + std::string(missing.size() > 1 ? "them" : "it") +
             " as the config folder (--config; its vae/, text_encoder/, text_encoder_2/ weights are used), or use a "
             "file that includes the text encoders (sd3_medium_incl_clips*.safetensors)";
      if (!options.config_dir.empty()) msg += "; " + options.config_dir.string() + " has no weights for it";
      throw Error(msg);
    }
  }

  {
    const std::string where = part("transformer", layout.transformer_prefix);
    const auto json = component_config(options, "transformer");
    auto sd = io::map_sd3_transformer(all, layout.transformer_prefix);
    const auto config = json ? models::SD3Transformer2DConfig::from_json(*json)
                             : models::SD3Transformer2DConfig::from_shapes(io::tensor_shapes(sd), where);
    if (json) m.configured.push_back("transformer");
    m.transformer = models::SD3Transformer2DModel(config);
    bind_strict(m.transformer, sd, where);
  }
  m.vae = load_latent_vae(all, layout.vae_prefix, options, models::AutoencoderKLConfig::sd3(),
                          part("vae", layout.vae_prefix), m.configured, m.from_config_dir);
  const auto clip = [&](const std::string& name, const std::string& prefix, const char* act) {
    if (prefix.empty()) {
      const auto dir = *folder_component(name);
      m.from_config_dir.push_back(name);
      return models::load_clip_text_model_with_projection(dir, folder_variant(dir));
    }
    const std::string where = part(name, prefix);
    const auto json = component_config(options, name);
    auto te = io::map_sd3_clip(all, prefix);
    const auto config = json ? models::CLIPTextConfig::from_json(*json) : infer_clip_text_config(te, act, where);
    if (json) m.configured.push_back(name);
    models::CLIPTextModelWithProjection model(config);
    bind_strict(model, te, where);
    return model;
  };
  m.text_encoder = clip("text_encoder", layout.clip_l_prefix, "quick_gelu");
  m.text_encoder_2 = clip("text_encoder_2", layout.clip_g_prefix, "gelu");
  m.tokenizer.max_length = static_cast<int>(m.text_encoder->text_model->config.max_position_embeddings);
  m.tokenizer_2.pad_token = "!";
  m.tokenizer_2.max_length = static_cast<int>(m.text_encoder_2->text_model->config.max_position_embeddings);

  const auto t5_dir = layout.t5_prefix.empty() ? folder_component("text_encoder_3") : std::nullopt;
  m.t5_available = !layout.t5_prefix.empty() || t5_dir.has_value();
  if (!options.config_dir.empty() && fs::is_directory(options.config_dir / "tokenizer_3"))
    m.t5_tokenizer_dir = options.config_dir / "tokenizer_3";
  if (m.t5_available && !load_t5) {
    m.t5 = "not loaded";
  } else if (!layout.t5_prefix.empty()) {
    const std::string where = part("text_encoder_3", layout.t5_prefix);
    const auto json = component_config(options, "text_encoder_3");
    auto t5 = io::map_sd3_t5(all, layout.t5_prefix);
    const auto config = json ? models::T5EncoderOptions::from_json(*json) : infer_t5_config(t5, where);
    if (json) m.configured.push_back("text_encoder_3");
    m.text_encoder_3 = models::T5Encoder(config);
    bind_strict(m.text_encoder_3, t5, where);
    m.t5 = "loaded";
  } else if (t5_dir) {
    m.text_encoder_3 = models::load_t5_encoder(*t5_dir, folder_variant(*t5_dir));
    m.from_config_dir.push_back("text_encoder_3");
    m.t5 = "loaded";
  }

  m.scheduler_text = R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0})";
  if (const auto sched = scheduler_config(options)) {
    m.scheduler_json = *sched;
    m.configured.push_back("scheduler");
  }
  log::get("pipeline").info(log::str(what, ": ", layout.variant, " single file, ", all.size(), " tensors, ",
                                     layout.depth, " blocks, T5 ", m.t5,
                                     config_dir_summary(options, m.configured, m.from_config_dir)));
  return m;
}

// --- FLUX.1 ----------------------------------------------------------------------------------------

std::string flux_scheduler_config(bool dev) {
  return std::string(R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
    "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, )") +
         (dev ? R"("shift": 3.0, "use_dynamic_shifting": true})" : R"("shift": 1.0, "use_dynamic_shifting": false})");
}

bool is_flux_single_file(const fs::path& file) {
  std::error_code ec;
  if (!ends_with(file.filename().string(), ".safetensors") || !fs::is_regular_file(file, ec)) return false;
  try {
    return io::is_flux_single_file(io::tensor_shapes(*io::SafetensorsArchive::open(file)));
  } catch (const Error&) {
    return false;  // unreadable: the SD loader reports it
  }
}

FluxSingleFileModels load_flux_single_file(const fs::path& file, const SingleFileOptions& options,
                                           at::ScalarType dtype) {
  const std::string what = file.string();
  if (!fs::is_regular_file(file)) throw Error(what + ": no such checkpoint file");
  if (!options.config_dir.empty() && !fs::is_directory(options.config_dir))
    throw Error(options.config_dir.string() + ": config folder for " + what + " does not exist");
  FluxSingleFileModels m;
  m.path = file;
  std::vector<io::TensorShape> shapes;
  StateDict all = read_single_file(file, shapes);
  m.layout = io::detect_flux_single_file(shapes, what);
  const auto& layout = m.layout;
  const auto part = [&](const std::string& name, const std::string& prefix) {
    return what + " (" + name + " at " + (prefix.empty() ? std::string("the top level") : prefix + "*") + ")";
  };
  const auto folder = [&](const std::string& name) { return config_component(options, name); };
  const auto dir_of = [&](const std::string& name) -> fs::path {
    if (options.config_dir.empty()) return {};
    const auto d = options.config_dir / name;
    return fs::is_directory(d) ? d : fs::path();
  };
  m.t5_tokenizer_dir = dir_of("tokenizer_2");
  if (m.t5_tokenizer_dir.empty() || !fs::exists(m.t5_tokenizer_dir / "spiece.model")) m.t5_tokenizer_dir = dir_of("tokenizer_3");
  {
    std::vector<std::string> missing;
    if (layout.vae_prefix.empty() && !folder("vae")) missing.push_back("the VAE (vae.* or first_stage_model.*)");
    if (layout.clip_l_prefix.empty() && !folder("text_encoder"))
      missing.push_back("the CLIP-L text encoder (text_encoders.clip_l.transformer.*)");
    if (layout.t5_prefix.empty() && !folder("text_encoder_2"))
      missing.push_back("the T5 text encoder (text_encoders.t5xxl.transformer.*)");
    if (m.t5_tokenizer_dir.empty()) missing.push_back("T5's tokenizer (single files carry none)");
    if (!missing.empty()) {
      std::string msg = what + ": " + layout.variant + " single file" +
                        (layout.vae_prefix.empty() && layout.clip_l_prefix.empty() && layout.t5_prefix.empty()
                             ? " holding the transformer alone"
                             : "") +
                        ": it lacks " + listing(missing) +
                        ". Give a diffusers FLUX.1 folder (FLUX.1-dev or FLUX.1-schnell) as the config folder (--config; "
                        "its vae/, text_encoder/, text_encoder_2/ and tokenizer_2/ are used)";
      if (!options.config_dir.empty()) msg += "; " + options.config_dir.string() + " has no weights or tokenizer for it";
      throw Error(msg);
    }
  }
  if (layout.fp8_scaled || layout.fp8) {
    all = io::dequantize_fp8(all, dtype, what, &m.fp8_scaled);
    if (layout.fp8)
      log::get("pipeline").info(log::str(what, ": float8 weights (", m.fp8_scaled, " with scales) dequantised to ",
                                         c10::toString(dtype), " at load; fp8 compute is not used yet"));
  }

  bool guidance_agrees = true;
  {
    const std::string where = part("transformer", layout.transformer_prefix);
    auto sd = io::map_flux_transformer(all, layout.transformer_prefix);
    const auto inferred = models::FluxTransformer2DConfig::from_shapes(io::tensor_shapes(sd), where);
    auto config = inferred;
    if (const auto json = component_config(options, "transformer")) {
      const auto folder_config = models::FluxTransformer2DConfig::from_json(*json);
      guidance_agrees = folder_config.guidance_embeds == inferred.guidance_embeds;
      if (guidance_agrees) {
        config = folder_config;
        m.configured.push_back("transformer");
      } else {
        log::get("pipeline").info(log::str(what, ": the file's transformer is ", layout.guidance ? "dev" : "schnell",
                                           "-style, the config folder's is not; the file's shapes and its own schedule are used"));
      }
    }
    m.transformer = models::FluxTransformer2DModel(config);
    bind_strict(m.transformer, sd, where);
  }
  m.vae = load_latent_vae(all, layout.vae_prefix, options, models::AutoencoderKLConfig::flux(),
                          part("vae", layout.vae_prefix), m.configured, m.from_config_dir);
  if (!layout.clip_l_prefix.empty()) {
    const std::string where = part("text_encoder", layout.clip_l_prefix);
    const auto json = component_config(options, "text_encoder");
    auto te = io::map_sd_clip(all, layout.clip_l_prefix);
    te.erase("text_projection.weight");  // FLUX takes CLIP-L's pooled output itself
    const auto config = json ? models::CLIPTextConfig::from_json(*json) : infer_clip_text_config(te, "quick_gelu", where);
    if (json) m.configured.push_back("text_encoder");
    m.text_encoder = models::CLIPTextModel(config);
    bind_strict(m.text_encoder, te, where);
  } else {
    const auto dir = *folder("text_encoder");
    m.text_encoder = models::load_clip_text_model(dir, folder_variant(dir));
    m.from_config_dir.push_back("text_encoder");
  }
  m.tokenizer.max_length = static_cast<int>(m.text_encoder->text_model->config.max_position_embeddings);
  if (const auto tok = dir_of("tokenizer");
      !tok.empty() && (fs::exists(tok / "vocab.json") || fs::exists(tok / "tokenizer.json")))
    m.clip_tokenizer_dir = tok;
  std::optional<io::SuspendedPlacement> t5_on_cpu;  // the caller places T5 itself
  if (options.t5_on_cpu) t5_on_cpu.emplace();
  if (!layout.t5_prefix.empty()) {
    const std::string where = part("text_encoder_2", layout.t5_prefix);
    const auto json = component_config(options, "text_encoder_2");
    auto t5 = io::map_sd3_t5(all, layout.t5_prefix);
    const auto config = json ? models::T5EncoderOptions::from_json(*json) : infer_t5_config(t5, where);
    if (json) m.configured.push_back("text_encoder_2");
    m.text_encoder_2 = models::T5Encoder(config);
    bind_strict(m.text_encoder_2, t5, where);
  } else {
    const auto dir = *folder("text_encoder_2");
    m.text_encoder_2 = models::load_t5_encoder(dir, folder_variant(dir));
    m.from_config_dir.push_back("text_encoder_2");
  }
  t5_on_cpu.reset();

  m.scheduler_text = flux_scheduler_config(layout.guidance);
  if (const auto sched = scheduler_config(options); sched && guidance_agrees) {
    m.scheduler_json = *sched;
    m.configured.push_back("scheduler");
  }
  log::get("pipeline").info(log::str(what, ": ", layout.variant, " single file, ", all.size(), " tensors, ",
                                     layout.double_blocks, " + ", layout.single_blocks, " blocks",
                                     layout.fp8 ? ", float8" : "",
                                     config_dir_summary(options, m.configured, m.from_config_dir)));
  return m;
}

// --- tokenizer ---------------------------------------------------------------------------------

fs::path find_clip_bpe(const fs::path& bpe_gz) {
  if (!bpe_gz.empty()) {
    if (fs::is_regular_file(bpe_gz)) return bpe_gz;
    throw Error(bpe_gz.string() + ": CLIP BPE vocabulary (bpe_simple_vocab_16e6.txt.gz) not found");
  }
  const fs::path relative = fs::path("resources") / "clip" / "bpe_simple_vocab_16e6.txt.gz";
  std::vector<fs::path> tried;
  const auto found = [&](const fs::path& p) {
    tried.push_back(p);
    std::error_code ec;
    return fs::is_regular_file(p, ec);
  };
  std::error_code ec;
  const auto exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (auto dir = exe.parent_path(); !dir.empty(); dir = dir.parent_path()) {
      if (found(dir / relative)) return dir / relative;
      if (found(dir / "share" / "diffract" / relative)) return dir / "share" / "diffract" / relative;
      if (dir == dir.parent_path()) break;
    }
  }
  // This file is core/pipeline/single_file.cpp of the source tree.
  const auto source = fs::path(__FILE__).parent_path().parent_path().parent_path() / relative;
  if (found(source)) return source;
  std::string msg = "CLIP BPE vocabulary " + relative.string() + " not found; tried:";
  for (const auto& p : tried) msg += "\n  " + p.string();
  throw Error(msg);
}

text::CLIPTokenizer make_clip_tokenizer(const text::CLIPTokenizerOptions& options, const fs::path& bpe_gz) {
  return text::CLIPTokenizer::from_openai_bpe(find_clip_bpe(bpe_gz), options);
}

}  // namespace diffract::pipeline
