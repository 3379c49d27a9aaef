#include "core/models/unets/unet_2d_condition.h"

#include <tuple>
#include <utility>

#include <ATen/ATen.h>

#include "core/io/diffusers_folder.h"
#include "core/io/json_file.h"
#include "core/io/weights.h"
#include "core/models/common/cancel_point.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/memory.h"

namespace diffract::models {

namespace nn = torch::nn;

namespace {

bool has_cross_attention(const std::string& block_type) { return block_type.rfind("CrossAttn", 0) == 0; }

// Every resnet of the UNet takes the time embedding and the config's norm settings.
ResnetBlock2DOptions resnet_options(const UNet2DConditionConfig& c, int64_t in_channels, int64_t out_channels) {
  ResnetBlock2DOptions r;
  r.in_channels = in_channels;
  r.out_channels = out_channels;
  r.temb_channels = c.time_embed_dim();
  r.groups = c.norm_num_groups;
  r.eps = c.norm_eps;
  return r;
}

// A scalar or a per-block list in config.json, as a list of `n`.
std::vector<int64_t> per_block(const io::JsonFile& j, const std::string& key, size_t n, int64_t fallback) {
  if (!j.has(key)) return std::vector<int64_t>(n, fallback);
  const auto& v = j.json()[key];
  if (v.is_number_integer()) return std::vector<int64_t>(n, v.get<int64_t>());
  if (v.is_array() && v.size() == n) {
    std::vector<int64_t> out;
    for (const auto& x : v) {
      if (!x.is_number_integer())
        throw Error(j.path().string() + ": '" + key + "' must hold integers per block, got " + io::json_brief(x));
      out.push_back(x.get<int64_t>());
    }
    return out;
  }
  throw Error(j.path().string() + ": '" + key + "' must be an integer or a list of " + std::to_string(n) +
              " (one per block), got " + io::json_brief(v));
}

}  // namespace

UNet2DConditionConfig UNet2DConditionConfig::sd15() {
  UNet2DConditionConfig c;
  c.down_block_types = {"CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"};
  c.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"};
  c.block_out_channels = {320, 640, 1280, 1280};
  c.layers_per_block = {2, 2, 2, 2};
  c.cross_attention_dim = {768, 768, 768, 768};
  c.transformer_layers_per_block = {1, 1, 1, 1};
  c.reverse_transformer_layers_per_block = {1, 1, 1, 1};
  c.num_attention_heads = {8, 8, 8, 8};
  return c;
}

UNet2DConditionConfig UNet2DConditionConfig::sd21() {
  auto c = sd15();
  c.sample_size = 96;
  c.cross_attention_dim = {1024, 1024, 1024, 1024};
  c.num_attention_heads = {5, 10, 20, 20};
  c.use_linear_projection = true;
  return c;
}

UNet2DConditionConfig UNet2DConditionConfig::sdxl_base() {
  UNet2DConditionConfig c;
  c.sample_size = 128;
  c.down_block_types = {"DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"};
  c.up_block_types = {"CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"};
  c.block_out_channels = {320, 640, 1280};
  c.layers_per_block = {2, 2, 2};
  c.cross_attention_dim = {2048, 2048, 2048};
  c.transformer_layers_per_block = {1, 2, 10};
  c.reverse_transformer_layers_per_block = {10, 2, 1};
  c.num_attention_heads = {5, 10, 20};
  c.use_linear_projection = true;
  c.addition_embed_type = "text_time";
  c.addition_time_embed_dim = 256;
  c.projection_class_embeddings_input_dim = 2816;
  return c;
}

UNet2DConditionConfig UNet2DConditionConfig::from_json(const std::filesystem::path& path) {
  return from_json(io::JsonFile::read(path));
}

UNet2DConditionConfig UNet2DConditionConfig::from_json(const io::JsonFile& j) {
  const std::string where = j.path().string();
  auto unsupported = [&](const std::string& key, const std::string& why) {
    throw Error(where + ": '" + key + "' = " + io::json_brief(j.json()[key]) + " is not supported (" + why + ")");
  };
  // Options that change the architecture beyond SD 1.x / 2.x / XL.
  for (const char* key : {"class_embed_type", "encoder_hid_dim", "encoder_hid_dim_type", "time_cond_proj_dim",
                          "num_class_embeds", "timestep_post_act"})
    if (j.has(key)) unsupported(key, "not used by SD 1.5, SD 2.x or SDXL");
  if (j.optional<bool>("dual_cross_attention", false)) unsupported("dual_cross_attention", "not used by SD models");
  if (j.has("only_cross_attention") && j.json()["only_cross_attention"] != false)
    unsupported("only_cross_attention", "not used by SD models");
  if (j.optional<std::string>("resnet_time_scale_shift", "default") != "default")
    unsupported("resnet_time_scale_shift", "only 'default'");
  if (j.optional<std::string>("time_embedding_type", "positional") != "positional")
    unsupported("time_embedding_type", "only 'positional'");
  if (j.optional<std::string>("attention_type", "default") != "default") unsupported("attention_type", "only 'default'");
  if (j.optional<int64_t>("conv_in_kernel", 3) != 3) unsupported("conv_in_kernel", "only 3");
  if (j.optional<int64_t>("conv_out_kernel", 3) != 3) unsupported("conv_out_kernel", "only 3");
  if (j.optional<std::string>("act_fn", "silu") != "silu") unsupported("act_fn", "only silu");
  if (j.optional<std::string>("mid_block_type", "UNetMidBlock2DCrossAttn") != "UNetMidBlock2DCrossAttn")
    unsupported("mid_block_type", "only UNetMidBlock2DCrossAttn");

  UNet2DConditionConfig c;
  c.in_channels = j.optional<int64_t>("in_channels", 4);
  c.out_channels = j.optional<int64_t>("out_channels", 4);
  c.sample_size = j.optional<int64_t>("sample_size", 64);
  c.flip_sin_to_cos = j.optional<bool>("flip_sin_to_cos", true);
  c.freq_shift = j.optional<double>("freq_shift", 0.0);
  c.down_block_types = j.required<std::vector<std::string>>("down_block_types");
  c.up_block_types = j.required<std::vector<std::string>>("up_block_types");
  c.block_out_channels = j.required<std::vector<int64_t>>("block_out_channels");
  const size_t n = c.down_block_types.size();
  if (n == 0 || c.up_block_types.size() != n || c.block_out_channels.size() != n)
    throw Error(where + ": down_block_types, up_block_types and block_out_channels must have the same non-zero length");
  for (const auto& t : c.down_block_types)
    if (t != "DownBlock2D" && t != "CrossAttnDownBlock2D")
      throw Error(where + ": down block type '" + t.substr(0, 60) + "' is not supported (DownBlock2D, CrossAttnDownBlock2D)");
  for (const auto& t : c.up_block_types)
    if (t != "UpBlock2D" && t != "CrossAttnUpBlock2D")
      throw Error(where + ": up block type '" + t.substr(0, 60) + "' is not supported (UpBlock2D, CrossAttnUpBlock2D)");
  c.layers_per_block = per_block(j, "layers_per_block", n, 2);
  c.cross_attention_dim = per_block(j, "cross_attention_dim", n, 1280);
  c.transformer_layers_per_block = per_block(j, "transformer_layers_per_block", n, 1);
  if (j.has("reverse_transformer_layers_per_block")) {
    // Per up block, a list per resnet; SD-family checkpoints use one value per block.
    const auto& all = j.json()["reverse_transformer_layers_per_block"];
    if (!all.is_array()) unsupported("reverse_transformer_layers_per_block", "needs a list");
    for (const auto& v : all) {
      const auto& depth = v.is_array() && !v.empty() ? v[0] : v;
      if (v.is_array() && (v.empty() || std::any_of(v.begin(), v.end(), [&](const auto& x) { return x != v[0]; })))
        unsupported("reverse_transformer_layers_per_block", "only one depth per up block");
      if (!depth.is_number_integer()) unsupported("reverse_transformer_layers_per_block", "needs whole numbers");
      c.reverse_transformer_layers_per_block.push_back(depth.get<int64_t>());
    }
    if (c.reverse_transformer_layers_per_block.size() != n)
      unsupported("reverse_transformer_layers_per_block", "needs one entry per up block");
  } else {
    c.reverse_transformer_layers_per_block.assign(c.transformer_layers_per_block.rbegin(),
                                                  c.transformer_layers_per_block.rend());
  }
  // diffusers reads the head count from attention_head_dim when num_attention_heads is absent
  // (a naming mix-up it keeps for compatibility).
  const std::string heads_key = j.has("num_attention_heads") ? "num_attention_heads" : "attention_head_dim";
  c.num_attention_heads = per_block(j, heads_key, n, 8);
  for (const auto h : c.num_attention_heads)
    if (h < 1 || h > 1024) throw Error(where + ": '" + heads_key + "' = " + std::to_string(h) + " is out of range (1 to 1024)");
  c.downsample_padding = j.optional<int64_t>("downsample_padding", 1);
  c.mid_block_scale_factor = j.optional<double>("mid_block_scale_factor", 1.0);
  c.norm_num_groups = j.optional<int64_t>("norm_num_groups", 32);
  c.norm_eps = j.optional<double>("norm_eps", 1e-5);
  c.use_linear_projection = j.optional<bool>("use_linear_projection", false);
  c.addition_embed_type = j.optional<std::string>("addition_embed_type", "");
  if (!c.addition_embed_type.empty() && c.addition_embed_type != "text_time")
    unsupported("addition_embed_type", "only 'text_time' (SDXL)");
  c.addition_time_embed_dim = j.optional<int64_t>("addition_time_embed_dim", 256);
  c.projection_class_embeddings_input_dim = j.optional<int64_t>("projection_class_embeddings_input_dim", 0);
  if (c.addition_embed_type == "text_time" && c.projection_class_embeddings_input_dim <= 0)
    throw Error(where + ": addition_embed_type 'text_time' needs projection_class_embeddings_input_dim");
  c.validate(where);
  return c;
}

void UNet2DConditionConfig::validate(const std::string& where) const {
  const auto& c = *this;
  const size_t n = c.block_out_channels.size();
  if (n == 0 || n > 8) throw Error(where + ": " + std::to_string(n) + " blocks (a UNet has 1 to 8)");
  const auto count = [&](const std::string& key, int64_t v, int64_t max) {
    if (v < 1 || v > max)
      throw Error(where + ": '" + key + "' = " + std::to_string(v) + " is out of range (1 to " + std::to_string(max) + ")");
  };
  const auto per_block = [&](const std::string& key, const std::vector<int64_t>& v, int64_t max) {
    if (v.size() != n)
      throw Error(where + ": '" + key + "' has " + std::to_string(v.size()) + " entries for " + std::to_string(n) + " blocks");
    for (auto x : v) count(key, x, max);
  };
  if (c.down_block_types.size() != n || c.up_block_types.size() != n)
    throw Error(where + ": down_block_types, up_block_types and block_out_channels must have the same length");
  count("out_channels", c.out_channels, 64);
  count("in_channels", c.in_channels, 2 * 64 + 1);  // an inpainting UNet: latents, mask, masked image
  count("sample_size", c.sample_size, 1024);
  per_block("block_out_channels", c.block_out_channels, 8192);
  per_block("layers_per_block", c.layers_per_block, 16);
  per_block("cross_attention_dim", c.cross_attention_dim, 16384);
  per_block("transformer_layers_per_block", c.transformer_layers_per_block, 64);
  per_block("reverse_transformer_layers_per_block", c.reverse_transformer_layers_per_block, 64);
  per_block("num_attention_heads", c.num_attention_heads, 1024);
  count("norm_num_groups", c.norm_num_groups, 1024);
  if (!(c.norm_eps > 0 && c.norm_eps < 1)) throw Error(where + ": 'norm_eps' must lie between 0 and 1");
  if (c.downsample_padding < 0 || c.downsample_padding > 1)
    throw Error(where + ": 'downsample_padding' must be 0 or 1, not " + std::to_string(c.downsample_padding));
  if (c.addition_embed_type == "text_time") {
    count("addition_time_embed_dim", c.addition_time_embed_dim, 4096);
    count("projection_class_embeddings_input_dim", c.projection_class_embeddings_input_dim, 65536);
  }
  for (size_t i = 0; i < n; ++i) {
    if (c.block_out_channels[i] % c.norm_num_groups != 0)
      throw Error(where + ": block_out_channels " + std::to_string(c.block_out_channels[i]) +
                  " is not divisible by norm_num_groups " + std::to_string(c.norm_num_groups));
    if (c.block_out_channels[i] % c.num_attention_heads[i] != 0)
      throw Error(where + ": block_out_channels " + std::to_string(c.block_out_channels[i]) +
                  " is not divisible by its " + std::to_string(c.num_attention_heads[i]) + " attention heads");
  }
  check_fits_in_memory(c.parameter_count(), where + ": the UNet it describes");
}

int64_t UNet2DConditionConfig::parameter_count() const {
  // A resnet: two 3x3 convolutions and its time projection; a transformer block: self- and
  // cross-attention, GEGLU feed-forward (4x), proj_in / proj_out per transformer.
  const int64_t temb = time_embed_dim();
  const auto resnet = [&](int64_t in, int64_t out) { return 9 * in * out + 9 * out * out + temb * out + (in != out) * in * out; };
  const auto block = [&](int64_t ch, int64_t ctx) { return 4 * ch * ch + 2 * ch * ctx + 2 * ch * ch + 12 * ch * ch; };
  int64_t total = 9 * in_channels * block_out_channels[0] + 9 * block_out_channels[0] * out_channels + 4 * temb * temb;
  for (size_t b = 0; b < block_out_channels.size(); ++b) {
    const int64_t ch = block_out_channels[b], in = b ? block_out_channels[b - 1] : ch, ctx = cross_attention_dim[b];
    const bool attn = down_block_types[b] == "CrossAttnDownBlock2D";
    const bool up_attn = up_block_types[block_out_channels.size() - 1 - b] == "CrossAttnUpBlock2D";
    total += resnet(in, ch) + (layers_per_block[b] - 1) * resnet(ch, ch) + 9 * ch * ch;  // + the downsampler
    total += (layers_per_block[b] + 1) * (resnet(2 * ch, ch) + 9 * ch * ch / (layers_per_block[b] + 1));  // up path
    if (attn) total += layers_per_block[b] * (transformer_layers_per_block[b] * block(ch, ctx) + 2 * ch * ch);
    if (up_attn)
      total += (layers_per_block[b] + 1) *
               (reverse_transformer_layers_per_block[block_out_channels.size() - 1 - b] * block(ch, ctx) + 2 * ch * ch);
  }
  const int64_t mid = block_out_channels.back();
  total += 2 * resnet(mid, mid) + transformer_layers_per_block.back() * block(mid, cross_attention_dim.back());
  return total;
}

BasicTransformerBlockImpl::BasicTransformerBlockImpl(int64_t dim, int64_t heads, int64_t dim_head,
                                                     int64_t cross_attention_dim) {
  auto ln = [&] { return LayerNorm(LayerNormOptions(dim).eps(1e-5)); };
  AttentionOptions self;
  self.query_dim = dim;
  self.heads = heads;
  self.dim_head = dim_head;
  AttentionOptions cross = self;
  cross.cross_attention_dim = cross_attention_dim;
  norm1 = register_module("norm1", ln());
  attn1 = register_module("attn1", Attention(self));
  norm2 = register_module("norm2", ln());
  attn2 = register_module("attn2", Attention(cross));
  norm3 = register_module("norm3", ln());
  ff = register_module("ff", FeedForward(dim, dim * 4));
}

at::Tensor BasicTransformerBlockImpl::forward(const at::Tensor& x, const at::Tensor& context) {
  const auto [h, y] = forward_deferred(x, {}, context);
  return h + y;
}

std::pair<at::Tensor, at::Tensor> BasicTransformerBlockImpl::forward_deferred(const at::Tensor& x,
                                                                               const at::Tensor& pending,
                                                                               const at::Tensor& context) {
  cancel_point();
  // The adds are the skip connections: each runs inside the kernel of the LayerNorm that reads
  // the sum, which saves a kernel and a pass over the activations per add.
  at::Tensor h = x, y;
  if (pending.defined()) std::tie(h, y) = norm1->forward_add(pending, x);
  else y = norm1->forward(x);
  std::tie(h, y) = norm2->forward_add(attn1->forward(y), h);
  std::tie(h, y) = norm3->forward_add(attn2->forward(y, context), h);
  return {h, ff->forward(y)};
}

Transformer2DModelImpl::Transformer2DModelImpl(int64_t channels, int64_t heads, int64_t layers,
                                               int64_t cross_attention_dim, int64_t groups, bool linear)
    : linear_projection(linear) {
  norm = register_module("norm", GroupNorm(GroupNormOptions(groups, channels).eps(1e-6)));
  if (linear) proj_in_linear = register_module("proj_in", Linear(channels, channels));
  else proj_in_conv = register_module("proj_in", Conv2d(Conv2dOptions(channels, channels, 1)));
  transformer_blocks = register_module("transformer_blocks", nn::ModuleList());
  for (int64_t i = 0; i < layers; ++i)
    transformer_blocks->push_back(BasicTransformerBlock(channels, heads, channels / heads, cross_attention_dim));
  if (linear) proj_out_linear = register_module("proj_out", Linear(channels, channels));
  else proj_out_conv = register_module("proj_out", Conv2d(Conv2dOptions(channels, channels, 1)));
}

at::Tensor Transformer2DModelImpl::forward(const at::Tensor& x, const at::Tensor& context) {
  const auto b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  auto to_tokens = [&](const at::Tensor& t) { return t.permute({0, 2, 3, 1}).reshape({b, h * w, c}); };
  auto hs = norm->forward(x);
  hs = linear_projection ? proj_in_linear->forward(to_tokens(hs)) : to_tokens(proj_in_conv->forward(hs));
  at::Tensor pending;
  for (const auto& block : *transformer_blocks)
    std::tie(hs, pending) = block->as<BasicTransformerBlock>()->forward_deferred(hs, pending, context);
  if (pending.defined()) hs = hs + pending;
  at::Tensor out;
  if (linear_projection) {
    out = proj_out_linear->forward(hs).reshape({b, h, w, c}).permute({0, 3, 1, 2}).contiguous(x.suggest_memory_format());
  } else {
    out = proj_out_conv->forward(hs.reshape({b, h, w, c}).permute({0, 3, 1, 2}));
  }
  return out + x;
}

DownBlockImpl::DownBlockImpl(const UNet2DConditionConfig& c, size_t i, int64_t in_channels, int64_t out_channels) {
  const bool cross = has_cross_attention(c.down_block_types[i]);
  resnets = register_module("resnets", nn::ModuleList());
  if (cross) attentions = register_module("attentions", nn::ModuleList());
  for (int64_t l = 0; l < c.layers_per_block[i]; ++l) {
    resnets->push_back(ResnetBlock2D(resnet_options(c, l == 0 ? in_channels : out_channels, out_channels)));
    if (cross)
      attentions->push_back(Transformer2DModel(out_channels, c.num_attention_heads[i], c.transformer_layers_per_block[i],
                                               c.cross_attention_dim[i], c.norm_num_groups, c.use_linear_projection));
  }
  if (i + 1 < c.down_block_types.size())
    downsamplers = register_module(
        "downsamplers", nn::ModuleList(Downsample2D(out_channels, out_channels, c.downsample_padding)));
}

at::Tensor DownBlockImpl::forward(at::Tensor x, const at::Tensor& temb, const at::Tensor& context,
                                  std::vector<at::Tensor>& skips) {
  for (size_t l = 0; l < resnets->size(); ++l) {
    x = resnets[l]->as<ResnetBlock2D>()->forward(x, temb);
    if (attentions) x = attentions[l]->as<Transformer2DModel>()->forward(x, context);
    skips.push_back(x);
  }
  if (downsamplers) {
    x = downsamplers[0]->as<Downsample2D>()->forward(x);
    skips.push_back(x);
  }
  return x;
}

MidBlockImpl::MidBlockImpl(const UNet2DConditionConfig& c) {
  const auto ch = c.block_out_channels.back();
  auto r = resnet_options(c, ch, ch);
  r.output_scale_factor = c.mid_block_scale_factor;
  resnets = register_module("resnets", nn::ModuleList(ResnetBlock2D(r), ResnetBlock2D(r)));
  attentions = register_module(
      "attentions", nn::ModuleList(Transformer2DModel(ch, c.num_attention_heads.back(), c.transformer_layers_per_block.back(),
                                                      c.cross_attention_dim.back(), c.norm_num_groups,
                                                      c.use_linear_projection)));
}

at::Tensor MidBlockImpl::forward(at::Tensor x, const at::Tensor& temb, const at::Tensor& context) {
  x = resnets[0]->as<ResnetBlock2D>()->forward(x, temb);
  x = attentions[0]->as<Transformer2DModel>()->forward(x, context);
  return resnets[1]->as<ResnetBlock2D>()->forward(x, temb);
}

UpBlockImpl::UpBlockImpl(const UNet2DConditionConfig& c, size_t i, int64_t prev_channels, int64_t out_channels,
                         const std::vector<int64_t>& skip_channels) {
  const size_t n = c.up_block_types.size();
  const size_t rev = n - 1 - i;  // the down block this one mirrors
  const bool cross = has_cross_attention(c.up_block_types[i]);
  resnets = register_module("resnets", nn::ModuleList());
  if (cross) attentions = register_module("attentions", nn::ModuleList());
  for (size_t l = 0; l < skip_channels.size(); ++l) {
    const int64_t in = (l == 0 ? prev_channels : out_channels) + skip_channels[l];
    resnets->push_back(ResnetBlock2D(resnet_options(c, in, out_channels)));
    if (cross)
      attentions->push_back(Transformer2DModel(out_channels, c.num_attention_heads[rev],
                                               c.reverse_transformer_layers_per_block[i], c.cross_attention_dim[rev],
                                               c.norm_num_groups, c.use_linear_projection));
  }
  if (i + 1 < n) upsamplers = register_module("upsamplers", nn::ModuleList(Upsample2D(out_channels, out_channels)));
}

at::Tensor UpBlockImpl::forward(at::Tensor x, const at::Tensor& temb, const at::Tensor& context,
                                std::vector<at::Tensor>& skips, at::IntArrayRef upsample_size) {
  return forward_part(std::move(x), temb, context, skips, 0, resnets->size(), true, upsample_size);
}

at::Tensor UpBlockImpl::forward_part(at::Tensor x, const at::Tensor& temb, const at::Tensor& context,
                                     std::vector<at::Tensor>& skips, size_t begin, size_t end, bool upsample,
                                     at::IntArrayRef upsample_size) {
  for (size_t l = begin; l < end; ++l) {
    x = at::cat({x, skips.back()}, 1);
    skips.pop_back();
    x = resnets[l]->as<ResnetBlock2D>()->forward(x, temb);
    if (attentions) x = attentions[l]->as<Transformer2DModel>()->forward(x, context);
  }
  if (upsample && upsamplers) x = upsamplers[0]->as<Upsample2D>()->forward(x, upsample_size);
  return x;
}

UNet2DConditionModelImpl::UNet2DConditionModelImpl(const UNet2DConditionConfig& c) : config(c) {
  c.validate("UNet config");
  const auto& ch = c.block_out_channels;
  const size_t n = ch.size();
  conv_in = register_module("conv_in", Conv2d(Conv2dOptions(c.in_channels, ch[0], 3).padding(1)));
  time_embedding = register_module("time_embedding", TimestepEmbedding(ch[0], c.time_embed_dim()));
  if (c.addition_embed_type == "text_time")
    add_embedding = register_module("add_embedding",
                                    TimestepEmbedding(c.projection_class_embeddings_input_dim, c.time_embed_dim()));

  // Channels of every skip connection, in the order the down path produces them.
  std::vector<int64_t> skip_channels = {ch[0]};
  down_blocks = register_module("down_blocks", nn::ModuleList());
  for (size_t i = 0; i < n; ++i) {
    down_blocks->push_back(DownBlock(c, i, i == 0 ? ch[0] : ch[i - 1], ch[i]));
    for (int64_t l = 0; l < c.layers_per_block[i]; ++l) skip_channels.push_back(ch[i]);
    if (i + 1 < n) skip_channels.push_back(ch[i]);
  }
  mid_block = register_module("mid_block", MidBlock(c));
  up_blocks = register_module("up_blocks", nn::ModuleList());
  int64_t prev = ch[n - 1];
  for (size_t i = 0; i < n; ++i) {
    const size_t rev = n - 1 - i;
    const auto count = static_cast<size_t>(c.layers_per_block[rev] + 1);
    std::vector<int64_t> skips(skip_channels.rbegin(), skip_channels.rbegin() + static_cast<long>(count));
    skip_channels.resize(skip_channels.size() - count);
    up_blocks->push_back(UpBlock(c, i, prev, ch[rev], skips));
    prev = ch[rev];
  }
  conv_norm_out = register_module("conv_norm_out",
                                  GroupNorm(GroupNormOptions(c.norm_num_groups, ch[0]).eps(c.norm_eps)));
  conv_out = register_module("conv_out", Conv2d(Conv2dOptions(ch[0], c.out_channels, 3).padding(1)));

  // The flat execution order forward() runs (forward_range).
  using K = Layer::Kind;
  layers_.push_back({K::ConvIn, 0, 0});
  for (size_t i = 0; i < n; ++i) {
    const auto* down = down_blocks[i]->as<DownBlock>();
    for (size_t l = 0; l < down->resnets->size(); ++l) layers_.push_back({K::Down, static_cast<int>(i), static_cast<int>(l)});
    if (down->downsamplers) layers_.push_back({K::Downsample, static_cast<int>(i), 0});
  }
  layers_.push_back({K::Mid, 0, 0});
  layers_.push_back({K::Mid, 0, 1});
  for (size_t i = 0; i < n; ++i) {
    const auto* up = up_blocks[i]->as<UpBlock>();
    for (size_t l = 0; l < up->resnets->size(); ++l) layers_.push_back({K::Up, static_cast<int>(i), static_cast<int>(l)});
    if (up->upsamplers) layers_.push_back({K::Upsample, static_cast<int>(i), 0});
  }
  layers_.push_back({K::Head, 0, 0});
}

std::string UNet2DConditionModelImpl::layer_name(const Layer& l) const {
  const auto b = std::to_string(l.block), r = std::to_string(l.index);
  switch (l.kind) {
    case Layer::Kind::ConvIn: return "conv_in";
    case Layer::Kind::Down: return "down_blocks." + b + ".resnets." + r;
    case Layer::Kind::Downsample: return "down_blocks." + b + ".downsamplers.0";
    case Layer::Kind::Mid: return l.index == 0 ? "mid_block.resnets.0+attentions.0" : "mid_block.resnets.1";
    case Layer::Kind::Up: return "up_blocks." + b + ".resnets." + r;
    case Layer::Kind::Upsample: return "up_blocks." + b + ".upsamplers.0";
    case Layer::Kind::Head: return "conv_norm_out+conv_out";
  }
  return "?";
}

std::pair<int, int> UNet2DConditionModelImpl::deep_cache_split(int branch) const {
  using K = Layer::Kind;
  int down = 0;
  for (const auto& l : layers_) down += l.kind == K::Down || l.kind == K::Downsample;
  if (branch < 0 || branch > down)
    throw Error("DeepCache: branch " + std::to_string(branch) + " is outside 0.." + std::to_string(down) +
                " (the UNet's down layers the shallow path may keep)");
  int ups = 0;
  for (int j = layer_count() - 1; j >= 0; --j)
    if (layers_[static_cast<size_t>(j)].kind == K::Up && ++ups == branch + 1) return {1 + branch, j};
  throw Error("DeepCache: the UNet's up path consumes fewer skips than its down path makes");
}

UNetStageState UNet2DConditionModelImpl::stage_begin(const at::Tensor& sample, const at::Tensor& timesteps,
                                                     const UNetConditioning& cond) {
  const auto t = timesteps.dim() == 0 ? timesteps.expand({sample.size(0)}) : timesteps;
  UNetStageState s;
  s.temb = embed_time(t, cond, sample.scalar_type());
  s.h = sample;
  return s;
}

void UNet2DConditionModelImpl::forward_range(UNetStageState& s, int begin, int end, const UNetConditioning& cond) {
  if (begin < 0 || end > layer_count() || begin > end)
    throw Error("UNet layers [" + std::to_string(begin) + ", " + std::to_string(end) + "): this UNet has layers 0 to " +
                std::to_string(layer_count() - 1));
  const auto& context = cond.encoder_hidden_states;
  for (int j = begin; j < end; ++j) {
    const auto& l = layers_[static_cast<size_t>(j)];
    const auto block = static_cast<size_t>(l.block), index = static_cast<size_t>(l.index);
    switch (l.kind) {
      case Layer::Kind::ConvIn:
        s.h = conv_in->forward(s.h);
        s.skips.push_back(s.h);
        break;
      case Layer::Kind::Down: {
        auto* down = down_blocks[block]->as<DownBlock>();
        s.h = down->resnets[index]->as<ResnetBlock2D>()->forward(s.h, s.temb);
        if (down->attentions) s.h = down->attentions[index]->as<Transformer2DModel>()->forward(s.h, context);
        s.skips.push_back(s.h);
        break;
      }
      case Layer::Kind::Downsample:
        s.h = down_blocks[block]->as<DownBlock>()->downsamplers[0]->as<Downsample2D>()->forward(s.h);
        s.skips.push_back(s.h);
        break;
      case Layer::Kind::Mid:
        if (index == 0) {
          s.h = mid_block->resnets[0]->as<ResnetBlock2D>()->forward(s.h, s.temb);
          s.h = mid_block->attentions[0]->as<Transformer2DModel>()->forward(s.h, context);
        } else {
          s.h = mid_block->resnets[1]->as<ResnetBlock2D>()->forward(s.h, s.temb);
        }
        break;
      case Layer::Kind::Up:
        if (s.skips.empty())
          throw Error("UNet layer " + std::to_string(j) + " (" + layer_name(l) + ") needs a skip the state does not carry");
        s.h = up_blocks[block]->as<UpBlock>()->forward_part(s.h, s.temb, context, s.skips, index, index + 1, false, {});
        break;
      case Layer::Kind::Upsample: {
        // To the size of the skip the next block consumes first (odd latent sizes), as run_up.
        if (s.skips.empty())
          throw Error("UNet layer " + std::to_string(j) + " (" + layer_name(l) + ") needs a skip the state does not carry");
        const auto& next = s.skips.back();
        const std::vector<int64_t> size = {next.size(2), next.size(3)};
        s.h = up_blocks[block]->as<UpBlock>()->upsamplers[0]->as<Upsample2D>()->forward(s.h, size);
        break;
      }
      case Layer::Kind::Head:
        s.h = conv_out->forward(conv_norm_out->forward(s.h, {}, /*silu=*/true));
        break;
    }
  }
}

namespace {

std::int64_t parameter_count(const nn::Module& m) {
  std::int64_t count = 0;
  for (const auto& p : m.parameters(true)) count += p.numel();
  return count;
}

// Self-attention's score and value products: 2 T^2 C per transformer block.
double attention_cost(const nn::ModuleList& attentions, size_t index, double tokens, std::int64_t channels) {
  if (!attentions) return 0;
  const auto blocks = attentions->ptr(index)->as<Transformer2DModel>()->transformer_blocks->size();
  return 2.0 * tokens * tokens * static_cast<double>(channels) * static_cast<double>(blocks);
}

}  // namespace

// Latent size at each level (after each downsampler), as Downsample2D computes it.
static std::vector<std::pair<std::int64_t, std::int64_t>> level_sizes(const UNet2DConditionConfig& c, std::int64_t height,
                                                                      std::int64_t width) {
  const std::int64_t p = c.downsample_padding, extra = p == 0 ? 1 : 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> sizes = {{height, width}};
  for (size_t i = 1; i < c.block_out_channels.size(); ++i) {
    const auto [h, w] = sizes.back();
    sizes.emplace_back((h + 2 * p + extra - 3) / 2 + 1, (w + 2 * p + extra - 3) / 2 + 1);
  }
  return sizes;
}

std::vector<UNetLayerInfo> UNet2DConditionModelImpl::layer_info(std::int64_t height, std::int64_t width) const {
  const auto sizes = level_sizes(config, height, width);
  const auto& ch = config.block_out_channels;
  const auto n = ch.size();
  const auto positions = [&](size_t level) {
    return static_cast<double>(sizes[level].first) * static_cast<double>(sizes[level].second);
  };
  std::vector<UNetLayerInfo> out;
  for (const auto& l : layers_) {
    const auto block = static_cast<size_t>(l.block), index = static_cast<size_t>(l.index);
    UNetLayerInfo info;
    info.name = layer_name(l);
    double attention = 0;
    size_t level = 0;
    switch (l.kind) {
      case Layer::Kind::ConvIn:
        info.parameters = parameter_count(*conv_in);
        break;
      case Layer::Kind::Down: {
        const auto* down = down_blocks->ptr(block)->as<DownBlock>();
        level = block;
        info.parameters = parameter_count(*down->resnets->ptr(index));
        if (down->attentions) info.parameters += parameter_count(*down->attentions->ptr(index));
        attention = attention_cost(down->attentions, index, positions(level), ch[block]);
        break;
      }
      case Layer::Kind::Downsample:
        level = block + 1;
        info.parameters = parameter_count(*down_blocks->ptr(block)->as<DownBlock>()->downsamplers->ptr(0));
        break;
      case Layer::Kind::Mid:
        level = n - 1;
        info.parameters = parameter_count(*mid_block->resnets->ptr(index));
        if (index == 0) {
          info.parameters += parameter_count(*mid_block->attentions->ptr(0));
          attention = attention_cost(mid_block->attentions, 0, positions(level), ch[n - 1]);
        }
        break;
      case Layer::Kind::Up: {
        const auto* up = up_blocks->ptr(block)->as<UpBlock>();
        level = n - 1 - block;
        info.parameters = parameter_count(*up->resnets->ptr(index));
        if (up->attentions) info.parameters += parameter_count(*up->attentions->ptr(index));
        attention = attention_cost(up->attentions, index, positions(level), ch[n - 1 - block]);
        break;
      }
      case Layer::Kind::Upsample:
        level = n - 2 - block;
        info.parameters = parameter_count(*up_blocks->ptr(block)->as<UpBlock>()->upsamplers->ptr(0));
        break;
      case Layer::Kind::Head:
        info.parameters = parameter_count(*conv_norm_out) + parameter_count(*conv_out);
        break;
    }
    info.cost = static_cast<double>(info.parameters) * positions(level) + attention;
    out.push_back(std::move(info));
  }
  return out;
}

std::vector<std::vector<std::int64_t>> UNet2DConditionModelImpl::stage_shapes(int layer, std::int64_t rows,
                                                                              std::int64_t height,
                                                                              std::int64_t width) const {
  if (layer < 0 || layer > layer_count())
    throw Error("UNet layer " + std::to_string(layer) + ": this UNet has layers 0 to " + std::to_string(layer_count() - 1));
  const auto sizes = level_sizes(config, height, width);
  const auto& ch = config.block_out_channels;
  const auto n = ch.size();
  const auto shape = [&](std::int64_t channels, size_t level) {
    return std::vector<std::int64_t>{rows, channels, sizes[level].first, sizes[level].second};
  };
  std::vector<std::int64_t> h = shape(config.in_channels, 0);
  std::vector<std::vector<std::int64_t>> skips;
  for (int j = 0; j < layer; ++j) {
    const auto& l = layers_[static_cast<size_t>(j)];
    const auto block = static_cast<size_t>(l.block);
    switch (l.kind) {
      case Layer::Kind::ConvIn: h = shape(ch[0], 0); skips.push_back(h); break;
      case Layer::Kind::Down: h = shape(ch[block], block); skips.push_back(h); break;
      case Layer::Kind::Downsample: h = shape(ch[block], block + 1); skips.push_back(h); break;
      case Layer::Kind::Mid: break;
      case Layer::Kind::Up: h = shape(ch[n - 1 - block], n - 1 - block); skips.pop_back(); break;
      case Layer::Kind::Upsample: h = shape(ch[n - 1 - block], n - 2 - block); break;
      case Layer::Kind::Head: h = shape(config.out_channels, 0); break;
    }
  }
  skips.insert(skips.begin(), h);
  return skips;
}

at::Tensor time_embedding_of(const UNet2DConditionConfig& c, TimestepEmbeddingImpl& time, TimestepEmbeddingImpl* add,
                             const at::Tensor& timesteps, const UNetConditioning& cond, c10::ScalarType dtype) {
  auto emb = time.forward(timestep_embedding(timesteps, c.block_out_channels.front(), c.flip_sin_to_cos, c.freq_shift).to(dtype));
  if (add) {
    TORCH_CHECK(cond.text_embeds.defined() && cond.time_ids.defined(),
                "text_time conditioning (SDXL) needs text_embeds and time_ids");
    const auto b = cond.time_ids.size(0);
    auto time_embeds = timestep_embedding(cond.time_ids.flatten(), c.addition_time_embed_dim, c.flip_sin_to_cos,
                                          c.freq_shift)
                           .reshape({b, -1});
    auto added = at::cat({cond.text_embeds, time_embeds.to(cond.text_embeds.dtype())}, -1).to(dtype);
    emb = emb + add->forward(added);
  }
  return emb;
}

at::Tensor UNet2DConditionModelImpl::embed_time(const at::Tensor& timesteps, const UNetConditioning& cond,
                                                c10::ScalarType dtype) {
  return time_embedding_of(config, *time_embedding, add_embedding ? add_embedding.get() : nullptr, timesteps, cond, dtype);
}

// Runs the up path from `from` (inclusive) to `to` (exclusive; an upsampler belongs to the
// block's last resnet). The upsampler targets the size of the skip the next block consumes
// first, so odd latent sizes come back exactly.
at::Tensor UNet2DConditionModelImpl::run_up(at::Tensor x, const at::Tensor& temb, const at::Tensor& context,
                                            std::vector<at::Tensor>& skips, SplitPoint from, SplitPoint to) {
  for (size_t i = from.up_block; i < up_blocks->size() && i <= to.up_block; ++i) {
    auto* up = up_blocks[i]->as<UpBlock>();
    const size_t begin = i == from.up_block ? from.up_resnet : 0;
    const size_t end = i == to.up_block ? to.up_resnet : up->resnets->size();
    const bool whole = end == up->resnets->size();
    std::vector<int64_t> size;
    if (whole && i + 1 < up_blocks->size()) {
      const auto& next = skips[skips.size() - (end - begin) - 1];
      size = {next.size(2), next.size(3)};
    }
    x = up->forward_part(x, temb, context, skips, begin, end, whole, size);
  }
  return x;
}

at::Tensor UNet2DConditionModelImpl::forward(const at::Tensor& sample, const at::Tensor& timesteps,
                                             const UNetConditioning& cond) {
  // sample [B, Cin, H, W], timesteps [B] -> [B, Cout, H, W]
  const auto& context = cond.encoder_hidden_states;
  const CrossKVScope cross_kv(cross_kv_.get(), context);
  const auto t = timesteps.dim() == 0 ? timesteps.expand({sample.size(0)}) : timesteps;
  const auto temb = embed_time(t, cond, sample.scalar_type());
  const TimeProjectionScope time_projections(time_projections_.get(), temb);
  auto x = conv_in->forward(sample);
  std::vector<at::Tensor> skips = {x};
  for (const auto& block : *down_blocks) x = block->as<DownBlock>()->forward(x, temb, context, skips);
  if (!cond.down_residuals.empty()) {
    TORCH_CHECK(cond.down_residuals.size() == skips.size(), "ControlNet residuals: ", cond.down_residuals.size(),
                " for the UNet's ", skips.size(), " skip connections");
    for (size_t i = 0; i < skips.size(); ++i) skips[i] = skips[i] + cond.down_residuals[i];
  }
  x = mid_block->forward(x, temb, context);
  if (cond.mid_residual.defined()) x = x + cond.mid_residual;
  x = run_up(x, temb, context, skips, {0, 0}, {up_blocks->size(), 0});
  return conv_out->forward(conv_norm_out->forward(x, {}, /*silu=*/true));
}

int UNet2DConditionModelImpl::fuse_cross_attention_kv() {
  cross_kv_ = CrossKV::fuse(*this);
  return cross_kv_ ? cross_kv_->size() : 0;
}

int UNet2DConditionModelImpl::fuse_time_projections() {
  time_projections_ = TimeProjections::fuse(*this);
  return time_projections_ ? time_projections_->size() : 0;
}

UNet2DConditionModelImpl::SplitPoint UNet2DConditionModelImpl::split_point(int split) const {
  const auto n = static_cast<int>(down_blocks->size());
  if (split < 1 || split >= n)
    throw Error("UNet split at down block " + std::to_string(split) + ": it must be 1 to " + std::to_string(n - 1) +
                " (this UNet has " + std::to_string(n) + " down blocks)");
  // The skips down_blocks[split..] produce, which the first up layers consume.
  size_t inner = 0;
  for (int i = split; i < n; ++i)
    inner += static_cast<size_t>(config.layers_per_block[static_cast<size_t>(i)]) + (i + 1 < n ? 1 : 0);
  SplitPoint p;
  while (inner > 0) {
    const auto count = up_blocks->ptr(p.up_block)->as<UpBlock>()->resnets->size();
    if (inner < count) {
      p.up_resnet = inner;
      break;
    }
    inner -= count;
    ++p.up_block;
  }
  return p;
}

UNetOuterState UNet2DConditionModelImpl::forward_outer_down(const at::Tensor& sample, const at::Tensor& timesteps,
                                                            const UNetConditioning& cond, int split) {
  split_point(split);
  const auto t = timesteps.dim() == 0 ? timesteps.expand({sample.size(0)}) : timesteps;
  UNetOuterState s;
  s.temb = embed_time(t, cond, sample.scalar_type());
  auto x = conv_in->forward(sample);
  s.skips = {x};
  for (int i = 0; i < split; ++i) x = down_blocks[static_cast<size_t>(i)]->as<DownBlock>()->forward(
      x, s.temb, cond.encoder_hidden_states, s.skips);
  s.h = x;
  return s;
}

at::Tensor UNet2DConditionModelImpl::forward_inner(const at::Tensor& h, const at::Tensor& timesteps,
                                                   const UNetConditioning& cond, int split) {
  const auto to = split_point(split);
  const auto& context = cond.encoder_hidden_states;
  const auto t = timesteps.dim() == 0 ? timesteps.expand({h.size(0)}) : timesteps;
  const auto temb = embed_time(t, cond, h.scalar_type());
  auto x = h;
  std::vector<at::Tensor> skips;
  for (size_t i = static_cast<size_t>(split); i < down_blocks->size(); ++i)
    x = down_blocks[i]->as<DownBlock>()->forward(x, temb, context, skips);
  x = mid_block->forward(x, temb, context);
  x = run_up(x, temb, context, skips, {0, 0}, to);
  TORCH_CHECK(skips.empty(), "UNet split: the inner stage left ", skips.size(), " skips");
  return x;
}

at::Tensor UNet2DConditionModelImpl::forward_outer_up(UNetOuterState state, const at::Tensor& inner,
                                                      const UNetConditioning& cond, int split) {
  const auto from = split_point(split);
  auto x = run_up(inner, state.temb, cond.encoder_hidden_states, state.skips, from, {up_blocks->size(), 0});
  return conv_out->forward(conv_norm_out->forward(x, {}, /*silu=*/true));
}

UNet2DConditionModel load_unet_2d_condition(const std::filesystem::path& dir, const std::string& variant) {
  const auto config = UNet2DConditionConfig::from_json(dir / "config.json");
  const auto weights = io::require_weights(dir, variant);
  UNet2DConditionModel model(config);
  model->eval();
  io::bind(*model, io::load_state_dict(weights), weights.string());
  log::get("models").debug(log::str(dir.string(), ": UNet with ", config.block_out_channels.size(), " blocks"));
  return model;
}

}  // namespace diffract::models
