#include "core/models/autoencoders/taesd.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <map>
#include <optional>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/upsampling.h>

#include "core/io/diffusers_folder.h"
#include "core/io/json_file.h"
#include "core/io/key_maps.h"
#include "core/io/weights.h"
#include "core/models/common/cancel_point.h"
#include "core/models/common/patch_parallel.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/options.h"

namespace diffract::models {

namespace nn = torch::nn;
namespace fs = std::filesystem;

namespace {

std::string shape_str(at::IntArrayRef shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return s;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

Conv2d conv3x3(int64_t in, int64_t out, int64_t stride = 1, bool bias = true) {
  return Conv2d(Conv2dOptions(in, out, 3).padding(1).stride(stride).bias(bias));
}

Conv2d conv1x1(int64_t in, int64_t out) { return Conv2d(Conv2dOptions(in, out, 1).bias(false)); }

std::atomic<bool> g_fused_taesd{[] {
  return options::flag(options::Id::FusedTaesd);
}()};

// relu(conv(x) + bias + alpha * z) in one cuDNN kernel. Without a residual, callers pass z = x
// (same shape in TAESD's blocks) at alpha 0 rather than ATen's cudnn_convolution_relu, which
// passes its own uninitialised output as z: cuDNN may read it, and 0 * NaN is NaN.
at::Tensor fused_conv_relu(Conv2dImpl& c, const at::Tensor& x, const at::Tensor& z, double alpha) {
  const int64_t s = c.options.stride_, p = c.options.padding_;
  // An undefined bias would make ATen allocate zeros on every call.
  const std::optional<at::Tensor> bias = c.bias.defined() ? std::optional<at::Tensor>(c.bias) : std::nullopt;
  return at::cudnn_convolution_add_relu(x, c.weight, z, at::Scalar(alpha), bias, {s, s}, {p, p}, {1, 1}, 1);
}

}  // namespace

void set_fused_taesd(bool on) { g_fused_taesd = on; }
bool fused_taesd_enabled() { return g_fused_taesd; }

// --- config ------------------------------------------------------------------------------------

int64_t TAESDConfig::downscale_factor() const {
  return int64_t(1) << (num_encoder_blocks.empty() ? 0 : num_encoder_blocks.size() - 1);
}

TAESDConfig TAESDConfig::taesd() { return {}; }

TAESDConfig TAESDConfig::taesdxl() {
  TAESDConfig c;
  c.variant = "taesdxl";
  return c;
}

TAESDConfig TAESDConfig::taesd3() {
  TAESDConfig c;
  c.variant = "taesd3";
  c.latent_channels = 16;
  return c;
}

TAESDConfig TAESDConfig::taef1() {
  TAESDConfig c = taesd3();
  c.variant = "taef1";
  return c;
}

TAESDConfig TAESDConfig::taef2() {
  TAESDConfig c;
  c.variant = "taef2";
  c.latent_channels = 32;
  c.midblock_group_norm = true;
  return c;
}

TAESDConfig TAESDConfig::from_json(const fs::path& path) {
  const auto j = io::JsonFile::read(path);
  const std::string where = path.string();
  TAESDConfig c;
  c.variant = "";
  c.latent_channels = j.required<int64_t>("latent_channels");
  c.encoder_block_out_channels = j.required<std::vector<int64_t>>("encoder_block_out_channels");
  c.decoder_block_out_channels = j.required<std::vector<int64_t>>("decoder_block_out_channels");
  c.num_encoder_blocks = j.required<std::vector<int64_t>>("num_encoder_blocks");
  c.num_decoder_blocks = j.required<std::vector<int64_t>>("num_decoder_blocks");
  c.in_channels = j.optional<int64_t>("in_channels", 3);
  c.out_channels = j.optional<int64_t>("out_channels", 3);
  c.upsampling_scaling_factor = j.optional<int64_t>("upsampling_scaling_factor", 2);
  c.latent_magnitude = j.optional<double>("latent_magnitude", 3.0);
  c.latent_shift = j.optional<double>("latent_shift", 0.5);
  c.scaling_factor = j.optional<double>("scaling_factor", 1.0);
  c.shift_factor = j.optional<double>("shift_factor", 0.0);
  const auto act = j.optional<std::string>("act_fn", "relu");
  if (act != "relu") throw Error(where + ": act_fn '" + act + "' is not supported (relu)");
  const auto up = j.optional<std::string>("upsample_fn", "nearest");
  if (up != "nearest") throw Error(where + ": upsample_fn '" + up + "' is not supported (nearest)");

  auto check = [&](const char* channels_key, const std::vector<int64_t>& channels, const char* blocks_key,
                   const std::vector<int64_t>& blocks) {
    if (channels.empty() || channels.size() != blocks.size())
      throw Error(where + ": '" + channels_key + "' and '" + blocks_key + "' must be non-empty and of equal length");
    for (auto ch : channels)
      if (ch != channels.front())
        throw Error(where + ": '" + channels_key + "' entries must all be equal (AutoencoderTiny chains its stages "
                    "without projections)");
    if (channels.front() <= 0) throw Error(where + ": '" + channels_key + "' must be positive");
    for (auto b : blocks)
      if (b < 0) throw Error(where + ": '" + blocks_key + "' entries must not be negative");
  };
  check("encoder_block_out_channels", c.encoder_block_out_channels, "num_encoder_blocks", c.num_encoder_blocks);
  check("decoder_block_out_channels", c.decoder_block_out_channels, "num_decoder_blocks", c.num_decoder_blocks);
  for (auto [name, v] : {std::pair{"latent_channels", c.latent_channels}, {"in_channels", c.in_channels},
                         {"out_channels", c.out_channels}, {"upsampling_scaling_factor", c.upsampling_scaling_factor}})
    if (v <= 0) throw Error(where + ": '" + name + "' must be positive, got " + std::to_string(v));
  return c;
}

// --- modules -----------------------------------------------------------------------------------

TAESDBlockImpl::TAESDBlockImpl(int64_t in, int64_t out, bool group_norm) {
  conv = register_module("conv", nn::Sequential(conv3x3(in, out), nn::ReLU(), conv3x3(out, out), nn::ReLU(),
                                                conv3x3(out, out)));
  if (in != out) skip = register_module("skip", conv1x1(in, out));
  if (group_norm)
    pool = register_module("pool", nn::Sequential(conv1x1(in, 4 * in), nn::GroupNorm(nn::GroupNormOptions(4, 4 * in)),
                                                  nn::ReLU(), conv1x1(4 * in, in)));
}

at::Tensor TAESDBlockImpl::forward(const at::Tensor& x) {
  cancel_point();
  // x: [B, Cin, H, W] -> [B, Cout, H, W].
  const at::Tensor h = pool ? x + pool->forward(x) : x;
  return at::relu(conv->forward(h) + (skip ? skip->forward(h) : h));
}

at::Tensor TAESDBlockImpl::forward_fused(const at::Tensor& x) {
  if (skip) return forward(x);  // no published TAESD has one: every block keeps its channels
  const at::Tensor h = pool ? x + pool->forward(x) : x;
  auto a = fused_conv_relu(conv->at<Conv2dImpl>(0), h, h, 0.0);
  a = fused_conv_relu(conv->at<Conv2dImpl>(2), a, a, 0.0);
  return fused_conv_relu(conv->at<Conv2dImpl>(4), a, h, 1.0);
}

TAESDEncoderImpl::TAESDEncoderImpl(const TAESDConfig& c) {
  layers = register_module("layers", nn::Sequential());
  const auto stages = c.num_encoder_blocks.size();
  for (std::size_t i = 0; i < stages; ++i) {
    const auto ch = c.encoder_block_out_channels[i];
    layers->push_back(i == 0 ? conv3x3(c.in_channels, ch) : conv3x3(ch, ch, 2, /*bias=*/false));
    const bool gn = c.midblock_group_norm && i + 1 == stages;
    for (int64_t b = 0; b < c.num_encoder_blocks[i]; ++b) layers->push_back(TAESDBlock(ch, ch, gn));
  }
  layers->push_back(conv3x3(c.encoder_block_out_channels.back(), c.latent_channels));
}

at::Tensor TAESDEncoderImpl::forward(const at::Tensor& x) {
  // x: images in [0, 1] [B, 3, H, W] -> latents [B, C, H / 8, W / 8].
  return layers->forward(x);
}

TAESDDecoderImpl::TAESDDecoderImpl(const TAESDConfig& c) {
  layers = register_module("layers", nn::Sequential());
  const auto& chs = c.decoder_block_out_channels;
  layers->push_back(conv3x3(c.latent_channels, chs.front()));
  layers->push_back(nn::ReLU());
  const auto stages = c.num_decoder_blocks.size();
  for (std::size_t i = 0; i < stages; ++i) {
    const auto ch = chs[i];
    const bool last = i + 1 == stages;
    const bool gn = c.midblock_group_norm && i == 0;
    for (int64_t b = 0; b < c.num_decoder_blocks[i]; ++b) layers->push_back(TAESDBlock(ch, ch, gn));
    if (!last) {
      const auto f = double(c.upsampling_scaling_factor);
      layers->push_back(nn::Upsample(nn::UpsampleOptions().scale_factor(std::vector<double>{f, f}).mode(torch::kNearest)));
    }
    layers->push_back(conv3x3(ch, last ? c.out_channels : ch, 1, /*bias=*/last));
  }
}

at::Tensor TAESDDecoderImpl::forward(const at::Tensor& z) {
  // z: latents [B, C, h, w] (already soft-clamped) -> images, roughly in [0, 1], [B, 3, 8h, 8w].
  if (!fused_applies(z)) return layers->forward(z);
  try {
    return forward_fused(z);
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error& e) {
    // What cuDNN cannot fuse (no engine for a graph) fails on the host while its plan is
    // built. The eager path redoes the whole decode from z; if it fails too, the fault is not
    // the fusion's and the switch stays as it was.
    auto out = layers->forward(z);
    g_fused_taesd = false;
    std::string what = e.what_without_backtrace();
    if (what.size() > 300) what = what.substr(0, 300) + "...";
    log::get("models").warn("TAESD: cuDNN's fused convolutions failed (" + what + "); decoding eagerly from now on");
    return out;
  }
}

bool TAESDDecoderImpl::fused_applies(const at::Tensor& z) {
  if (!g_fused_taesd || !z.is_cuda() || (z.scalar_type() != at::kHalf && z.scalar_type() != at::kBFloat16)) return false;
  const auto& w = layers->at<Conv2dImpl>(0).weight;
  return w.device() == z.device() && w.scalar_type() == z.scalar_type() && at::globalContext().userEnabledCuDNN() &&
         at::globalContext().hasCuDNN() && !at::GradMode::is_enabled() && !patch_context();
}

at::Tensor TAESDDecoderImpl::forward_fused(const at::Tensor& z) {
  // cuDNN fuses in NHWC: with channels-last input every layer stays channels-last, whatever the
  // weights' format.
  at::Tensor h = z.contiguous(at::MemoryFormat::ChannelsLast);
  for (auto& layer : *layers) {
    if (auto* block = layer.ptr()->as<TAESDBlockImpl>()) h = block->forward_fused(h);
    else h = layer.forward(h);
  }
  return h;
}

TAESDImpl::TAESDImpl(const TAESDConfig& c, bool with_encoder, bool with_decoder) : config(c) {
  if (with_encoder) encoder = register_module("encoder", TAESDEncoder(c));
  if (with_decoder) decoder = register_module("decoder", TAESDDecoder(c));
}

namespace {
at::TensorOptions param_options(const nn::Module& m) {
  const auto params = m.parameters();
  return params.empty() ? at::TensorOptions().dtype(at::kFloat) : params.front().options();
}
}  // namespace

at::Tensor TAESDImpl::encode(const at::Tensor& images) {
  // images: [B, 3, H, W] in [-1, 1] -> latents [B, C, H / 8, W / 8].
  const std::string what = source.empty() ? std::string("TAESD") : source;
  if (!encoder)
    throw Error(what + ": this TAESD has no encoder (only a decoder was loaded); load the matching *_encoder "
                "file as well to encode images");
  const auto f = config.downscale_factor();
  if (images.dim() != 4 || images.size(1) != config.in_channels)
    throw Error(what + ": encode expects images [B, " + std::to_string(config.in_channels) + ", H, W], got " +
                shape_str(images.sizes()));
  if (images.size(2) % f != 0 || images.size(3) % f != 0)
    throw Error(what + ": image size " + std::to_string(images.size(2)) + "x" + std::to_string(images.size(3)) +
                " is not a multiple of " + std::to_string(f));
  const auto opts = param_options(*encoder);
  return encoder->forward(images.to(opts.device(), opts.dtype().toScalarType()).add(1).div(2));
}

at::Tensor TAESDImpl::decode(const at::Tensor& latents) {
  // latents: [B, C, h, w] -> images [B, 3, 8h, 8w] in [-1, 1].
  const std::string what = source.empty() ? std::string("TAESD") : source;
  if (!decoder) throw Error(what + ": this TAESD has no decoder (only an encoder was loaded)");
  if (latents.dim() != 4 || latents.size(1) != config.latent_channels)
    throw Error(what + ": decode expects latents [B, " + std::to_string(config.latent_channels) + ", h, w], got " +
                shape_str(latents.sizes()));
  const auto opts = param_options(*decoder);
  const auto z = latents.to(opts.device(), opts.dtype().toScalarType());
  return decoder->forward(at::tanh(z / 3) * 3).mul(2).sub(1);
}

// --- loading -----------------------------------------------------------------------------------

namespace {

bool any_key(const io::StateDict& w, const std::string& prefix) {
  return std::any_of(w.begin(), w.end(), [&](const auto& kv) { return kv.first.rfind(prefix, 0) == 0; });
}

bool has_pool(const io::StateDict& w) {
  return std::any_of(w.begin(), w.end(), [](const auto& kv) { return contains(kv.first, ".pool."); });
}

// The published variant with these latent channels / GroupNorm, refined by names in `hint`
// (file or folder names); "" when none fits.
std::string name_variant(int64_t channels, bool group_norm, const std::string& hint) {
  const std::string h = lower(hint);
  if (group_norm) return channels == 32 ? "taef2" : "";
  if (channels == 4) return contains(h, "taesdxl") ? "taesdxl" : "taesd";
  if (channels == 16) return contains(h, "taef1") ? "taef1" : "taesd3";
  return "";
}

// Checks that the weights (already in our key layout) have the fixed architecture of the
// original files and names their variant.
TAESDConfig detect_variant(const io::StateDict& w, const std::string& what, const std::string& hint) {
  const bool enc = any_key(w, "encoder."), dec = any_key(w, "decoder.");
  const bool gn = has_pool(w);
  std::string problem;
  int64_t channels = -1;
  auto shape_of = [&](const std::string& key) -> std::optional<std::vector<int64_t>> {
    auto it = w.find(key);
    if (it == w.end()) return std::nullopt;
    return it->second.sizes().vec();
  };
  auto describe = [&](const std::string& key) {
    auto s = shape_of(key);
    return key + (s ? " is " + shape_str(*s) : " is missing");
  };
  if (enc) {
    const auto in = shape_of("encoder.layers.0.weight"), out = shape_of("encoder.layers.14.weight");
    if (!in || *in != std::vector<int64_t>{64, 3, 3, 3}) problem = describe("encoder.layers.0.weight") + ", expected [64, 3, 3, 3]";
    else if (!out || out->size() != 4 || (*out)[1] != 64 || (*out)[2] != 3 || (*out)[3] != 3)
      problem = describe("encoder.layers.14.weight") + ", expected [C, 64, 3, 3]";
    else channels = (*out)[0];
  }
  if (dec && problem.empty()) {
    const auto in = shape_of("decoder.layers.0.weight"), out = shape_of("decoder.layers.18.weight");
    if (!in || in->size() != 4 || (*in)[0] != 64 || (*in)[2] != 3 || (*in)[3] != 3)
      problem = describe("decoder.layers.0.weight") + ", expected [64, C, 3, 3]";
    else if (!out || *out != std::vector<int64_t>{3, 64, 3, 3})
      problem = describe("decoder.layers.18.weight") + ", expected [3, 64, 3, 3]";
    else if (channels != -1 && (*in)[1] != channels)
      problem = "the encoder has " + std::to_string(channels) + " latent channels, the decoder " +
                std::to_string((*in)[1]);
    else channels = (*in)[1];
  }
  if (!enc && !dec) problem = "no encoder or decoder tensors";
  std::string variant;
  if (problem.empty()) {
    variant = name_variant(channels, gn, hint);
    if (variant.empty())
      problem = std::to_string(channels) + " latent channels" + (gn ? " with" : " without") + " the mid-block GroupNorm";
  }
  if (!problem.empty())
    throw Error(what + ": tensor shapes match no TAESD variant (taesd / taesdxl: 4 latent channels, taesd3 / taef1: 16, "
                "taef2: 32 with the mid-block GroupNorm): " + problem);
  TAESDConfig c = variant == "taesdxl" ? TAESDConfig::taesdxl()
                  : variant == "taesd3" ? TAESDConfig::taesd3()
                  : variant == "taef1"  ? TAESDConfig::taef1()
                  : variant == "taef2"  ? TAESDConfig::taef2()
                                        : TAESDConfig::taesd();
  return c;
}

bool is_checkpoint(const std::string& name) {
  for (const char* ext : {".pth", ".pt", ".safetensors"})
    if (name.size() > std::string(ext).size() && name.compare(name.size() - std::string(ext).size(), std::string::npos, ext) == 0)
      return true;
  return false;
}

// "taef2_decoder.pth" -> {"taef2", "decoder"}; nullopt for other names.
std::optional<std::pair<std::string, std::string>> split_part_name(const fs::path& file) {
  const std::string stem = lower(file.stem().string());
  for (const char* part : {"encoder", "decoder"}) {
    const std::string suffix = std::string(part);
    if (stem.size() >= suffix.size() && stem.compare(stem.size() - suffix.size(), std::string::npos, suffix) == 0) {
      std::string prefix = stem.substr(0, stem.size() - suffix.size());
      while (!prefix.empty() && (prefix.back() == '_' || prefix.back() == '-' || prefix.back() == '.')) prefix.pop_back();
      return std::pair{prefix, std::string(part)};
    }
  }
  return std::nullopt;
}

// Which part an original-layout file holds: its name, else its keys (the encoder's layer 0 is
// a conv; the decoder's is the parameter-free clamp).
std::string part_of(const fs::path& file, const io::StateDict& w) {
  if (auto named = split_part_name(file)) return named->second;
  const std::string stem = lower(file.stem().string());
  if (contains(stem, "decoder")) return "decoder";
  if (contains(stem, "encoder")) return "encoder";
  return w.count("0.weight") ? "encoder" : "decoder";
}

io::StateDict load_original(const fs::path& file, const std::string& part) {
  auto w = io::load_state_dict(file);
  try {
    return io::map_taesd_keys(std::move(w), part);
  } catch (const Error& e) {
    throw Error(file.string() + ": " + e.what());
  }
}

TAESD build(const TAESDConfig& config, const io::StateDict& weights, const std::string& what) {
  const bool enc = any_key(weights, "encoder."), dec = any_key(weights, "decoder.");
  if (!enc && !dec) throw Error(what + ": no TAESD encoder or decoder tensors");
  TAESD model(config, enc, dec);
  model->eval();
  model->source = what;
  io::bind(*model, weights, what);
  log::get("models").debug(log::str(what, ": TAESD ", config.variant.empty() ? "(custom)" : config.variant, ", ",
                                    config.latent_channels, " latent channels", enc ? ", encoder" : "",
                                    dec ? ", decoder" : ""));
  return model;
}

TAESD load_diffusers_folder(const fs::path& dir) {
  auto config = TAESDConfig::from_json(dir / "config.json");
  const auto weights = io::require_weights(dir, "");
  auto w = io::load_state_dict(weights);
  config.midblock_group_norm = has_pool(w);
  const TAESDConfig standard;
  const bool standard_arch = config.encoder_block_out_channels == standard.encoder_block_out_channels &&
                             config.decoder_block_out_channels == standard.decoder_block_out_channels &&
                             config.num_encoder_blocks == standard.num_encoder_blocks &&
                             config.num_decoder_blocks == standard.num_decoder_blocks && config.in_channels == 3 &&
                             config.out_channels == 3 && config.upsampling_scaling_factor == 2;
  config.variant = standard_arch ? name_variant(config.latent_channels, config.midblock_group_norm,
                                                fs::absolute(dir).lexically_normal().string())
                                 : "";
  return build(config, w, weights.string());
}

}  // namespace

TAESD load_taesd(const fs::path& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (fs::exists(path / "config.json")) return load_diffusers_folder(path);
    std::map<std::string, std::map<std::string, fs::path>> found;  // name -> part -> file
    for (const auto& entry : fs::directory_iterator(path)) {
      if (!entry.is_regular_file() || !is_checkpoint(entry.path().filename().string())) continue;
      if (auto named = split_part_name(entry.path())) {
        auto& slot = found[named->first][named->second];
        if (slot.empty() || entry.path().extension() == ".safetensors") slot = entry.path();
      }
    }
    if (found.empty())
      throw Error(path.string() + ": neither a diffusers folder (config.json) nor a folder of TAESD files "
                  "(<name>_encoder.pth / <name>_decoder.pth)");
    if (found.size() > 1) {
      std::string names;
      for (const auto& [name, parts] : found) names += (names.empty() ? "" : ", ") + name;
      throw Error(path.string() + ": holds several TAESD models (" + names + "); pass one file");
    }
    const auto& parts = found.begin()->second;
    io::StateDict merged;
    std::string what, hint = found.begin()->first;
    for (const auto& [part, file] : parts) {
      auto w = load_original(file, part);
      merged.insert(std::make_move_iterator(w.begin()), std::make_move_iterator(w.end()));
      what += (what.empty() ? "" : " + ") + file.string();
    }
    return build(detect_variant(merged, what, hint), merged, what);
  }
  if (!fs::exists(path, ec)) throw Error(path.string() + ": no such file or folder");
  auto w = io::load_state_dict(path);
  const bool diffusers_layout = any_key(w, "encoder.layers.") || any_key(w, "decoder.layers.");
  if (!diffusers_layout) {
    const auto part = part_of(path, w);
    try {
      w = io::map_taesd_keys(std::move(w), part);
    } catch (const Error& e) {
      throw Error(path.string() + ": " + e.what());
    }
  }
  return build(detect_variant(w, path.string(), path.filename().string()), w, path.string());
}

}  // namespace diffract::models
