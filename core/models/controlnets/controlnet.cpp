#include "core/models/controlnets/controlnet.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "core/io/diffusers_folder.h"
#include "core/io/json_file.h"
#include "core/io/weights.h"
#include "core/util/error.h"

namespace diffract::models {

namespace nn = torch::nn;

ControlNetConfig ControlNetConfig::from_json(const std::filesystem::path& path) {
  const auto file = io::JsonFile::read(path);
  const std::string where = path.string();
  const auto& j = file.json();
  if (!j.is_object()) throw Error(where + ": not a JSON object");
  if (j.value("_class_name", std::string("ControlNetModel")) != "ControlNetModel")
    throw Error(where + ": a " + j.value("_class_name", std::string()) + ", not a ControlNetModel");
  if (file.optional<std::string>("controlnet_conditioning_channel_order", "rgb") != "rgb")
    throw Error(where + ": controlnet_conditioning_channel_order '" +
                file.optional<std::string>("controlnet_conditioning_channel_order", "") + "' is not supported (only rgb)");
  // The encoder's fields are a UNet's; its up blocks mirror the down blocks (unused here).
  auto unet = j;
  std::vector<std::string> up;
  for (const auto& t : file.required<std::vector<std::string>>("down_block_types"))
    up.insert(up.begin(), t == "CrossAttnDownBlock2D" ? "CrossAttnUpBlock2D" : "UpBlock2D");
  unet["up_block_types"] = up;
  for (const char* key : {"conditioning_channels", "conditioning_embedding_out_channels", "global_pool_conditions",
                          "controlnet_conditioning_channel_order"})
    unet.erase(key);
  ControlNetConfig c;
  c.unet = UNet2DConditionConfig::from_json(io::JsonFile(path, unet));
  c.conditioning_channels = file.optional<int64_t>("conditioning_channels", 3);
  c.conditioning_embedding_out_channels =
      file.optional<std::vector<int64_t>>("conditioning_embedding_out_channels", {16, 32, 96, 256});
  if (c.conditioning_embedding_out_channels.empty())
    throw Error(where + ": conditioning_embedding_out_channels is empty");
  c.global_pool_conditions = file.optional<bool>("global_pool_conditions", false);
  if (c.global_pool_conditions)
    throw Error(where + ": global_pool_conditions (guess-mode ControlNets such as shuffle) is not supported yet");
  return c;
}

ControlNetConditioningEmbeddingImpl::ControlNetConditioningEmbeddingImpl(int64_t embedding_channels,
                                                                         int64_t conditioning_channels,
                                                                         const std::vector<int64_t>& ch) {
  conv_in = register_module("conv_in", Conv2d(Conv2dOptions(conditioning_channels, ch.front(), 3).padding(1)));
  blocks = register_module("blocks", nn::ModuleList());
  for (size_t i = 0; i + 1 < ch.size(); ++i) {
    blocks->push_back(Conv2d(Conv2dOptions(ch[i], ch[i], 3).padding(1)));
    blocks->push_back(Conv2d(Conv2dOptions(ch[i], ch[i + 1], 3).padding(1).stride(2)));
  }
  conv_out = register_module("conv_out", Conv2d(Conv2dOptions(ch.back(), embedding_channels, 3).padding(1)));
}

at::Tensor ControlNetConditioningEmbeddingImpl::forward(const at::Tensor& cond) {
  auto x = at::silu(conv_in->forward(cond));
  for (const auto& b : *blocks) x = at::silu(b->as<Conv2d>()->forward(x));
  return conv_out->forward(x);
}

ControlNetModelImpl::ControlNetModelImpl(const ControlNetConfig& cfg) : config(cfg) {
  const auto& c = cfg.unet;
  c.validate("ControlNet config");
  if (cfg.conditioning_channels < 1 || cfg.conditioning_channels > 64 || cfg.conditioning_embedding_out_channels.empty() ||
      std::any_of(cfg.conditioning_embedding_out_channels.begin(), cfg.conditioning_embedding_out_channels.end(),
                  [](int64_t ch) { return ch < 1 || ch > 8192; }))
    throw Error("ControlNet config: conditioning_channels or conditioning_embedding_out_channels out of range");
  const auto& ch = c.block_out_channels;
  const size_t n = ch.size();
  conv_in = register_module("conv_in", Conv2d(Conv2dOptions(c.in_channels, ch[0], 3).padding(1)));
  time_embedding = register_module("time_embedding", TimestepEmbedding(ch[0], c.time_embed_dim()));
  if (c.addition_embed_type == "text_time")
    add_embedding = register_module("add_embedding",
                                    TimestepEmbedding(c.projection_class_embeddings_input_dim, c.time_embed_dim()));
  controlnet_cond_embedding = register_module(
      "controlnet_cond_embedding",
      ControlNetConditioningEmbedding(ch[0], cfg.conditioning_channels, cfg.conditioning_embedding_out_channels));
  down_blocks = register_module("down_blocks", nn::ModuleList());
  controlnet_down_blocks = register_module("controlnet_down_blocks", nn::ModuleList());
  controlnet_down_blocks->push_back(Conv2d(Conv2dOptions(ch[0], ch[0], 1)));
  for (size_t i = 0; i < n; ++i) {
    down_blocks->push_back(DownBlock(c, i, i == 0 ? ch[0] : ch[i - 1], ch[i]));
    for (int64_t l = 0; l < c.layers_per_block[i]; ++l) controlnet_down_blocks->push_back(Conv2d(Conv2dOptions(ch[i], ch[i], 1)));
    if (i + 1 < n) controlnet_down_blocks->push_back(Conv2d(Conv2dOptions(ch[i], ch[i], 1)));
  }
  mid_block = register_module("mid_block", MidBlock(c));
  controlnet_mid_block = register_module("controlnet_mid_block", Conv2d(Conv2dOptions(ch[n - 1], ch[n - 1], 1)));
}

ControlNetOutput ControlNetModelImpl::forward(const at::Tensor& sample, const at::Tensor& timesteps,
                                              const UNetConditioning& cond, const at::Tensor& control_image,
                                              double scale) {
  const auto t = timesteps.dim() == 0 ? timesteps.expand({sample.size(0)}) : timesteps;
  const auto emb = time_embedding_of(config.unet, *time_embedding, add_embedding ? add_embedding.get() : nullptr, t,
                                     cond, sample.scalar_type());
  auto x = conv_in->forward(sample) + controlnet_cond_embedding->forward(control_image.to(sample.scalar_type()));
  std::vector<at::Tensor> skips = {x};
  for (const auto& block : *down_blocks) x = block->as<DownBlock>()->forward(x, emb, cond.encoder_hidden_states, skips);
  x = mid_block->forward(x, emb, cond.encoder_hidden_states);
  ControlNetOutput out;
  for (size_t i = 0; i < skips.size(); ++i) {
    auto r = controlnet_down_blocks[i]->as<Conv2d>()->forward(skips[i]) * scale;
    out.down.push_back(config.global_pool_conditions ? r.mean({2, 3}, /*keepdim=*/true) : r);
  }
  out.mid = controlnet_mid_block->forward(x) * scale;
  if (config.global_pool_conditions) out.mid = out.mid.mean({2, 3}, /*keepdim=*/true);
  return out;
}

bool ControlNetUnit::acts(int step, int steps) const {
  if (scale == 0 || steps <= 0) return false;
  const double i = step, n = steps;
  return !(i / n < start || (i + 1) / n > end);
}

ControlNetUnit ControlNetUnit::rows(int64_t begin, int64_t count) const {
  auto u = *this;
  u.image = image.narrow(0, begin, count);
  return u;
}

namespace {

// The unit's residuals for x at t: eager, or replayed from its graphs (the scale a device scalar
// input, so that one graph serves every scale).
ControlNetOutput run_unit(const ControlNetUnit& u, const UNetConditioning& cond, const at::Tensor& x, const at::Tensor& t) {
  auto net = u.net;  // the holder shares the module; forward() is not const
  if (!u.graphs || !x.is_cuda()) return net->forward(x, t, cond, u.image, u.scale);
  const auto rows = t.to(x.device(), at::kFloat);
  std::vector<at::Tensor> in = {x, rows.dim() == 0 ? rows.expand({x.size(0)}) : rows, cond.encoder_hidden_states, u.image};
  const bool added = cond.text_embeds.defined();
  if (added) {
    in.push_back(cond.text_embeds);
    in.push_back(cond.time_ids);
  }
  in.push_back(at::full({}, u.scale, x.options()));
  const auto outs = u.graphs->run(
      {added ? 1 : 0}, in,
      [net, added](const std::vector<at::Tensor>& v) mutable {
        UNetConditioning c;
        c.encoder_hidden_states = v[2];
        if (added) {
          c.text_embeds = v[4];
          c.time_ids = v[5];
        }
        auto o = net->forward(v[0], v[1], c, v[3], 1.0);
        std::vector<at::Tensor> r;
        for (auto& d : o.down) r.push_back(d * v.back());
        r.push_back(o.mid * v.back());
        return r;
      },
      u.layout);
  ControlNetOutput o;
  o.down.assign(outs.begin(), outs.end() - 1);
  o.mid = outs.back();
  return o;
}

}  // namespace

UNetConditioning add_controlnet_residuals(const UNetConditioning& cond, const std::vector<ControlNetUnit>& units,
                                          const at::Tensor& x, const at::Tensor& t, int step, int steps) {
  auto c = cond;
  for (const auto& u : units) {
    if (!u.acts(step, steps)) continue;
    if (u.image.size(0) != x.size(0))
      throw Error("ControlNet: a control image of " + std::to_string(u.image.size(0)) + " rows for a UNet input of " +
                  std::to_string(x.size(0)));
    auto out = run_unit(u, cond, x, t);
    if (c.down_residuals.empty()) {
      c.down_residuals = std::move(out.down);
      c.mid_residual = out.mid;
    } else {
      for (size_t k = 0; k < out.down.size(); ++k) c.down_residuals[k] = c.down_residuals[k] + out.down[k];
      c.mid_residual = c.mid_residual + out.mid;
    }
  }
  return c;
}

ControlNetModel load_controlnet(const std::filesystem::path& dir, const std::string& variant) {
  if (!std::filesystem::is_directory(dir))
    throw Error("ControlNet " + dir.string() +
                ": not a folder or a file (a diffusers ControlNetModel folder, or one file: its .safetensors, or "
                "lllyasviel's original .pth / .safetensors)");
  const auto config = ControlNetConfig::from_json(dir / "config.json");
  const auto weights = io::require_weights(dir, variant);
  ControlNetModel model(config);
  model->eval();
  io::bind(*model, io::load_state_dict(weights), weights.string());
  return model;
}

}  // namespace diffract::models
