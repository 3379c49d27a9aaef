#include "core/models/autoencoders/autoencoder_kl.h"

#include <ATen/ATen.h>

#include "core/io/diffusers_folder.h"
#include "core/io/json_file.h"
#include "core/io/weights.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace diffract::models {

namespace nn = torch::nn;

namespace {

std::string shape_str(at::IntArrayRef shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

at::ScalarType param_dtype(const nn::Module& m) {
  const auto params = m.parameters();
  return params.empty() ? at::kFloat : params.front().scalar_type();
}

at::Device param_device(const nn::Module& m) {
  const auto params = m.parameters();
  return params.empty() ? at::Device(at::kCPU) : params.front().device();
}

// A fresh fp32 module on `device` holding `src`'s parameters.
template <typename M>
M fp32_copy(const M& src, M fresh, at::Device device) {
  at::NoGradGuard no_grad;
  fresh->to(device, at::kFloat);
  auto targets = fresh->named_parameters(true);
  for (const auto& p : src->named_parameters(true)) targets[p.key()].copy_(p.value());
  return fresh;
}

}  // namespace

// --- config ------------------------------------------------------------------------------------

int64_t AutoencoderKLConfig::downscale_factor() const {
  return int64_t(1) << (block_out_channels.empty() ? 0 : block_out_channels.size() - 1);
}

AutoencoderKLConfig AutoencoderKLConfig::sd() { return {}; }

AutoencoderKLConfig AutoencoderKLConfig::sdxl() {
  AutoencoderKLConfig c;
  c.sample_size = 1024;
  c.scaling_factor = 0.13025;
  return c;
}

AutoencoderKLConfig AutoencoderKLConfig::sd3() {
  AutoencoderKLConfig c;
  c.latent_channels = 16;
  c.sample_size = 1024;
  c.scaling_factor = 1.5305;
  c.shift_factor = 0.0609;
  c.use_quant_conv = false;
  c.use_post_quant_conv = false;
  return c;
}

AutoencoderKLConfig AutoencoderKLConfig::flux() {
  AutoencoderKLConfig c = sd3();
  c.scaling_factor = 0.3611;
  c.shift_factor = 0.1159;
  return c;
}

AutoencoderKLConfig AutoencoderKLConfig::from_json(const std::filesystem::path& path) {
  const auto j = io::JsonFile::read(path);
  const std::string where = path.string();
  AutoencoderKLConfig c;
  c.block_out_channels = j.required<std::vector<int64_t>>("block_out_channels");
  c.down_block_types = j.required<std::vector<std::string>>("down_block_types");
  c.up_block_types = j.required<std::vector<std::string>>("up_block_types");
  c.layers_per_block = j.required<int64_t>("layers_per_block");
  c.latent_channels = j.required<int64_t>("latent_channels");
  // diffusers' AutoencoderKL.__init__ defaults from here on.
  c.in_channels = j.optional<int64_t>("in_channels", 3);
  c.out_channels = j.optional<int64_t>("out_channels", 3);
  c.norm_num_groups = j.optional<int64_t>("norm_num_groups", 32);
  c.sample_size = 32;
  if (j.has("sample_size")) {
    const auto& s = j.json().at("sample_size");
    if (s.is_array() && !s.empty() && s[0].is_number_integer()) c.sample_size = s[0].get<int64_t>();
    else c.sample_size = j.required<int64_t>("sample_size");
  }
  c.scaling_factor = j.optional<double>("scaling_factor", 0.18215);
  if (j.has("shift_factor")) c.shift_factor = j.required<double>("shift_factor");
  c.force_upcast = j.optional<bool>("force_upcast", true);
  c.use_quant_conv = j.optional<bool>("use_quant_conv", true);
  c.use_post_quant_conv = j.optional<bool>("use_post_quant_conv", true);
  c.mid_block_add_attention = j.optional<bool>("mid_block_add_attention", true);

  const auto act = j.optional<std::string>("act_fn", "silu");
  if (act != "silu" && act != "swish")
    throw Error(where + ": act_fn '" + act + "' is not supported (AutoencoderKL VAEs use silu)");
  if (c.block_out_channels.empty()) throw Error(where + ": 'block_out_channels' is empty");
  const auto n = c.block_out_channels.size();
  auto check_types = [&](const char* key, const std::vector<std::string>& types, const char* supported) {
    if (types.size() != n)
      throw Error(where + ": '" + key + "' has " + std::to_string(types.size()) + " entries but block_out_channels has " +
                  std::to_string(n));
    for (std::size_t i = 0; i < types.size(); ++i)
      if (types[i] != supported)
        throw Error(where + ": " + key + "[" + std::to_string(i) + "] '" + types[i] + "' is not supported (only " +
                    supported + ")");
  };
  check_types("down_block_types", c.down_block_types, "DownEncoderBlock2D");
  check_types("up_block_types", c.up_block_types, "UpDecoderBlock2D");
  for (auto [name, v] : {std::pair{"layers_per_block", c.layers_per_block}, {"latent_channels", c.latent_channels},
                         {"in_channels", c.in_channels}, {"out_channels", c.out_channels},
                         {"norm_num_groups", c.norm_num_groups}})
    if (v <= 0) throw Error(where + ": '" + name + "' must be positive, got " + std::to_string(v));
  for (auto ch : c.block_out_channels)
    if (ch <= 0 || ch % c.norm_num_groups != 0)
      throw Error(where + ": block_out_channels entry " + std::to_string(ch) + " is not a positive multiple of norm_num_groups " +
                  std::to_string(c.norm_num_groups));
  return c;
}

// --- distribution ------------------------------------------------------------------------------

at::Tensor LatentDistribution::std() const { return at::exp(0.5 * logvar); }

at::Tensor LatentDistribution::sample(std::optional<at::Generator> generator) const {
  const at::Device device = generator && generator->defined() ? generator->device() : mean.device();
  auto eps = at::randn(mean.sizes(), generator, mean.options().device(device));
  return mean + std() * eps.to(mean.device());
}

// --- blocks ------------------------------------------------------------------------------------

namespace {
ResnetBlock2D vae_resnet(int64_t in, int64_t out, int64_t groups) {
  ResnetBlock2DOptions o;
  o.in_channels = in;
  o.out_channels = out;
  o.groups = groups;
  o.eps = 1e-6;
  return ResnetBlock2D(o);
}
}  // namespace

DownEncoderBlock2DImpl::DownEncoderBlock2DImpl(int64_t in, int64_t out, int64_t layers, int64_t groups,
                                               bool downsample) {
  resnets = register_module("resnets", nn::ModuleList());
  for (int64_t i = 0; i < layers; ++i) resnets->push_back(vae_resnet(i == 0 ? in : out, out, groups));
  if (downsample) downsamplers = register_module("downsamplers", nn::ModuleList(Downsample2D(out, out, 0)));
}

at::Tensor DownEncoderBlock2DImpl::forward(const at::Tensor& x) {
  at::Tensor h = x;
  for (const auto& r : *resnets) h = r->as<ResnetBlock2D>()->forward(h);
  if (downsamplers) h = downsamplers[0]->as<Downsample2D>()->forward(h);
  return h;
}

UpDecoderBlock2DImpl::UpDecoderBlock2DImpl(int64_t in, int64_t out, int64_t layers, int64_t groups, bool upsample) {
  resnets = register_module("resnets", nn::ModuleList());
  for (int64_t i = 0; i < layers; ++i) resnets->push_back(vae_resnet(i == 0 ? in : out, out, groups));
  if (upsample) upsamplers = register_module("upsamplers", nn::ModuleList(Upsample2D(out, out)));
}

at::Tensor UpDecoderBlock2DImpl::forward(const at::Tensor& x) {
  at::Tensor h = x;
  for (const auto& r : *resnets) h = r->as<ResnetBlock2D>()->forward(h);
  if (upsamplers) h = upsamplers[0]->as<Upsample2D>()->forward(h);
  return h;
}

VAEMidBlock2DImpl::VAEMidBlock2DImpl(int64_t channels, int64_t groups, bool add_attention) {
  resnets = register_module("resnets", nn::ModuleList(vae_resnet(channels, channels, groups),
                                                      vae_resnet(channels, channels, groups)));
  if (add_attention) {
    AttentionOptions o;  // UNetMidBlock2D with attention_head_dim = channels: one head
    o.query_dim = channels;
    o.heads = 1;
    o.dim_head = channels;
    o.bias = true;
    o.norm_num_groups = groups;
    o.norm_eps = 1e-6;
    o.residual_connection = true;
    attentions = register_module("attentions", nn::ModuleList(Attention(o)));
  }
}

at::Tensor VAEMidBlock2DImpl::forward(const at::Tensor& x) {
  // x: [B, C, H, W] -> [B, C, H, W].
  auto h = resnets[0]->as<ResnetBlock2D>()->forward(x);
  if (attentions) h = attentions[0]->as<Attention>()->forward(h);
  return resnets[1]->as<ResnetBlock2D>()->forward(h);
}

VAEEncoderImpl::VAEEncoderImpl(const AutoencoderKLConfig& c) {
  const auto& ch = c.block_out_channels;
  conv_in = register_module("conv_in", Conv2d(Conv2dOptions(c.in_channels, ch.front(), 3).padding(1)));
  down_blocks = register_module("down_blocks", nn::ModuleList());
  for (std::size_t i = 0; i < ch.size(); ++i)
    down_blocks->push_back(DownEncoderBlock2D(i == 0 ? ch.front() : ch[i - 1], ch[i], c.layers_per_block,
                                              c.norm_num_groups, i + 1 < ch.size()));
  mid_block = register_module("mid_block", VAEMidBlock2D(ch.back(), c.norm_num_groups, c.mid_block_add_attention));
  conv_norm_out = register_module(
      "conv_norm_out", GroupNorm(GroupNormOptions(c.norm_num_groups, ch.back()).eps(1e-6)));
  conv_out = register_module("conv_out",
                             Conv2d(Conv2dOptions(ch.back(), 2 * c.latent_channels, 3).padding(1)));
}

at::Tensor VAEEncoderImpl::forward(const at::Tensor& images) {
  // images: [B, 3, H, W] -> moments [B, 2C, H / f, W / f].
  auto h = conv_in->forward(images);
  for (const auto& b : *down_blocks) h = b->as<DownEncoderBlock2D>()->forward(h);
  h = mid_block->forward(h);
  return conv_out->forward(conv_norm_out->forward(h, {}, /*silu=*/true));
}

VAEDecoderImpl::VAEDecoderImpl(const AutoencoderKLConfig& c) {
  const std::vector<int64_t> ch(c.block_out_channels.rbegin(), c.block_out_channels.rend());
  conv_in = register_module("conv_in", Conv2d(Conv2dOptions(c.latent_channels, ch.front(), 3).padding(1)));
  mid_block = register_module("mid_block", VAEMidBlock2D(ch.front(), c.norm_num_groups, c.mid_block_add_attention));
  up_blocks = register_module("up_blocks", nn::ModuleList());
  for (std::size_t i = 0; i < ch.size(); ++i)
    up_blocks->push_back(UpDecoderBlock2D(i == 0 ? ch.front() : ch[i - 1], ch[i], c.layers_per_block + 1,
                                          c.norm_num_groups, i + 1 < ch.size()));
  conv_norm_out = register_module(
      "conv_norm_out", GroupNorm(GroupNormOptions(c.norm_num_groups, ch.back()).eps(1e-6)));
  conv_out = register_module("conv_out", Conv2d(Conv2dOptions(ch.back(), c.out_channels, 3).padding(1)));
}

at::Tensor VAEDecoderImpl::forward(const at::Tensor& z) {
  // z: [B, C, h, w] (after post_quant_conv) -> images [B, 3, h * f, w * f].
  auto h = mid_block->forward(conv_in->forward(z));
  for (const auto& b : *up_blocks) h = b->as<UpDecoderBlock2D>()->forward(h);
  return conv_out->forward(conv_norm_out->forward(h, {}, /*silu=*/true));
}

// --- AutoencoderKL -----------------------------------------------------------------------------

AutoencoderKLImpl::AutoencoderKLImpl(const AutoencoderKLConfig& c) : config(c) {
  encoder = register_module("encoder", VAEEncoder(c));
  decoder = register_module("decoder", VAEDecoder(c));
  const auto twice = 2 * c.latent_channels;
  if (c.use_quant_conv) quant_conv = register_module("quant_conv", Conv2d(Conv2dOptions(twice, twice, 1)));
  if (c.use_post_quant_conv)
    post_quant_conv = register_module(
        "post_quant_conv", Conv2d(Conv2dOptions(c.latent_channels, c.latent_channels, 1)));
}

bool AutoencoderKLImpl::upcasts() const { return config.force_upcast && param_dtype(*this) == at::kHalf; }

void AutoencoderKLImpl::release_fp32_copies() {
  encoder_fp32_ = nullptr;
  decoder_fp32_ = nullptr;
  quant_conv_fp32_ = nullptr;
  post_quant_conv_fp32_ = nullptr;
}

LatentDistribution AutoencoderKLImpl::encode(const at::Tensor& images) {
  // images: [B, in_channels, H, W] in [-1, 1] -> {mean, logvar}: [B, latent_channels, H / f, W / f].
  const auto f = config.downscale_factor();
  if (images.dim() != 4 || images.size(1) != config.in_channels)
    throw Error("AutoencoderKL.encode: expects images [B, " + std::to_string(config.in_channels) + ", H, W], got " +
                shape_str(images.sizes()));
  if (images.size(2) % f != 0 || images.size(3) % f != 0)
    throw Error("AutoencoderKL.encode: image size " + std::to_string(images.size(2)) + "x" +
                std::to_string(images.size(3)) + " is not a multiple of " + std::to_string(f));
  const auto device = param_device(*this);
  VAEEncoder enc = encoder;
  Conv2d quant = quant_conv;
  at::ScalarType dtype = param_dtype(*this);
  if (upcasts()) {
    if (!encoder_fp32_) {
      encoder_fp32_ = fp32_copy(encoder, VAEEncoder(config), device);
      const auto twice = 2 * config.latent_channels;
      if (quant_conv) quant_conv_fp32_ = fp32_copy(quant_conv, Conv2d(Conv2dOptions(twice, twice, 1)), device);
    }
    enc = encoder_fp32_, quant = quant_conv_fp32_, dtype = at::kFloat;
  }
  auto moments = enc->forward(images.to(device, dtype));
  if (quant) moments = quant->forward(moments);
  auto parts = moments.chunk(2, 1);
  return {parts[0], at::clamp(parts[1], -30.0, 20.0)};
}

at::Tensor AutoencoderKLImpl::decode(const at::Tensor& z) {
  // z: unscaled latents [B, latent_channels, h, w] -> images [B, out_channels, h * f, w * f].
  if (z.dim() != 4 || z.size(1) != config.latent_channels)
    throw Error("AutoencoderKL.decode: expects latents [B, " + std::to_string(config.latent_channels) +
                ", h, w], got " + shape_str(z.sizes()));
  auto m = decode_modules();
  auto h = z.to(param_device(*this), m.dtype);
  if (m.post_quant_conv) h = m.post_quant_conv->forward(h);
  return m.decoder->forward(h);
}

AutoencoderKLImpl::DecodeModules AutoencoderKLImpl::decode_modules() {
  if (!upcasts()) return {decoder, post_quant_conv, param_dtype(*this)};
  if (!decoder_fp32_) {
    const auto device = param_device(*this);
    decoder_fp32_ = fp32_copy(decoder, VAEDecoder(config), device);
    const auto c = config.latent_channels;
    if (post_quant_conv) post_quant_conv_fp32_ = fp32_copy(post_quant_conv, Conv2d(Conv2dOptions(c, c, 1)), device);
  }
  return {decoder_fp32_, post_quant_conv_fp32_, at::kFloat};
}

namespace {
// Tile starts along an axis of n latents: stride tile - overlap, the last tile flush with the end.
std::vector<int64_t> tile_starts(int64_t n, int64_t tile, int64_t overlap) {
  std::vector<int64_t> starts;
  for (int64_t s = 0;; s += tile - overlap) {
    if (s + tile >= n) {
      starts.push_back(std::max<int64_t>(n - tile, 0));
      break;
    }
    starts.push_back(s);
  }
  return starts;
}

// Weights along one axis of a tile of `len` pixels: a linear ramp over `ramp` pixels on each side
// that meets a neighbouring tile, 1 elsewhere.
at::Tensor ramp_weights(int64_t len, int64_t ramp, bool before, bool after, const at::TensorOptions& o) {
  auto w = at::ones({len}, o);
  if (ramp <= 0) return w;
  const auto r = at::arange(1, ramp + 1, o) / static_cast<double>(ramp + 1);
  if (before) w.narrow(0, 0, ramp).copy_(r);
  if (after) w.narrow(0, len - ramp, ramp).mul_(r.flip(0));
  return w;
}
}  // namespace

at::Tensor decode_in_tiles(const at::Tensor& z, int64_t tile, int64_t overlap, int64_t f,
                           const std::function<at::Tensor(const at::Tensor&)>& decode) {
  // z: [B, C, h, w] -> [B, C_out, h * f, w * f].
  if (tile < 2 || overlap < 0 || overlap >= tile)
    throw Error("tiled decode: tile must be 2 or more and overlap in [0, tile), got tile " + std::to_string(tile) +
                ", overlap " + std::to_string(overlap));
  const int64_t h = z.size(2), w = z.size(3);
  const auto ys = tile_starts(h, tile, overlap), xs = tile_starts(w, tile, overlap);
  at::Tensor out, weight;
  for (std::size_t iy = 0; iy < ys.size(); ++iy) {
    for (std::size_t ix = 0; ix < xs.size(); ++ix) {
      const int64_t th = std::min(tile, h), tw = std::min(tile, w);
      auto img = decode(z.narrow(2, ys[iy], th).narrow(3, xs[ix], tw)).to(at::kFloat);
      if (!out.defined()) {
        out = at::zeros({z.size(0), img.size(1), h * f, w * f}, img.options());
        weight = at::zeros({1, 1, h * f, w * f}, img.options());
      }
      // Ramps only as wide as the overlap actually shared with that neighbour.
      const auto o = img.options();
      const int64_t up = iy > 0 ? (ys[iy - 1] + th - ys[iy]) * f : 0;
      const int64_t down = iy + 1 < ys.size() ? (ys[iy] + th - ys[iy + 1]) * f : 0;
      const int64_t left = ix > 0 ? (xs[ix - 1] + tw - xs[ix]) * f : 0;
      const int64_t right = ix + 1 < xs.size() ? (xs[ix] + tw - xs[ix + 1]) * f : 0;
      auto wy = ramp_weights(th * f, 0, false, false, o);
      if (up > 0) wy.narrow(0, 0, up).copy_(ramp_weights(up, up, true, false, o));
      if (down > 0) wy.narrow(0, th * f - down, down).mul_(ramp_weights(down, down, false, true, o));
      auto wx = ramp_weights(tw * f, 0, false, false, o);
      if (left > 0) wx.narrow(0, 0, left).copy_(ramp_weights(left, left, true, false, o));
      if (right > 0) wx.narrow(0, tw * f - right, right).mul_(ramp_weights(right, right, false, true, o));
      const auto mask = (wy.view({th * f, 1}) * wx.view({1, tw * f})).view({1, 1, th * f, tw * f});
      out.narrow(2, ys[iy] * f, th * f).narrow(3, xs[ix] * f, tw * f).add_(img * mask);
      weight.narrow(2, ys[iy] * f, th * f).narrow(3, xs[ix] * f, tw * f).add_(mask);
    }
  }
  return out / weight;
}

at::Tensor AutoencoderKLImpl::decode_tiled(const at::Tensor& z, int64_t tile, int64_t overlap) {
  // z: unscaled latents [B, C, h, w] -> images [B, out_channels, h * f, w * f].
  if (z.dim() != 4 || (z.size(2) <= tile && z.size(3) <= tile)) return decode(z);  // decode() names shape errors
  return decode_in_tiles(z, tile, overlap, config.downscale_factor(), [this](const at::Tensor& t) { return decode(t); })
      .to(upcasts() ? at::kFloat : param_dtype(*this));
}

at::Tensor AutoencoderKLImpl::scale_latents(const at::Tensor& z) const {
  return (config.shift_factor ? z - *config.shift_factor : z) * config.scaling_factor;
}

at::Tensor AutoencoderKLImpl::unscale_latents(const at::Tensor& x) const {
  auto z = x / config.scaling_factor;
  return config.shift_factor ? z + *config.shift_factor : z;
}

AutoencoderKL load_autoencoder_kl(const std::filesystem::path& dir, const std::string& variant) {
  const auto config = AutoencoderKLConfig::from_json(dir / "config.json");
  const auto weights = io::require_weights(dir, variant);
  AutoencoderKL model(config);
  model->eval();
  io::bind(*model, io::load_state_dict(weights), weights.string());
  log::get("models").debug(log::str(dir.string(), ": AutoencoderKL, ", config.latent_channels, " latent channels, ",
                                    config.block_out_channels.size(), " blocks, scaling ", config.scaling_factor));
  return model;
}

}  // namespace diffract::models
