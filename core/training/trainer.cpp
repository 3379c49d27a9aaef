#include "core/training/trainer.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <nlohmann/json.hpp>
#include <torch/serialize.h>

#include "core/io/json_file.h"
#include "core/io/safetensors_writer.h"
#include "core/io/weights.h"
#include "core/schedulers/schedule.h"
#include "core/text/clip_tokenizer.h"
#include "core/training/scenes.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace diffract::training {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// bf16 autocast on one device type for the guard's lifetime.
class AutocastGuard {
 public:
  AutocastGuard(bool on, at::DeviceType type) : on_(on), type_(type) {
    if (!on_) return;
    previous_ = at::autocast::is_autocast_enabled(type_);
    previous_dtype_ = at::autocast::get_autocast_dtype(type_);
    at::autocast::set_autocast_enabled(type_, true);
    at::autocast::set_autocast_dtype(type_, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(type_, previous_);
    at::autocast::set_autocast_dtype(type_, previous_dtype_);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool on_, previous_ = false;
  at::DeviceType type_;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

at::Device parse_train_device(const std::string& name) {
  try {
    at::Device d(name);
    if (d.is_cuda() && !at::hasCUDA()) throw Error("device " + name + ": this build or machine has no CUDA");
    if (!d.is_cpu() && !d.is_cuda()) throw Error("device " + name + ": only cpu and cuda:N train");
    return d;
  } catch (const c10::Error&) {
    throw Error("device '" + name + "' is not cpu or cuda:N");
  }
}

void write_json(const fs::path& path, const json& j) {
  std::ofstream out(path);
  if (!out) throw Error(path.string() + ": cannot write");
  out << j.dump(2) << '\n';
}

json unet_config_json(const models::UNet2DConditionConfig& c) {
  return {{"_class_name", "UNet2DConditionModel"},
          {"_diffusers_version", "0.42.1"},
          {"act_fn", "silu"},
          {"attention_head_dim", c.num_attention_heads},
          {"block_out_channels", c.block_out_channels},
          {"center_input_sample", false},
          {"cross_attention_dim", c.cross_attention_dim.front()},
          {"down_block_types", c.down_block_types},
          {"downsample_padding", c.downsample_padding},
          {"flip_sin_to_cos", c.flip_sin_to_cos},
          {"freq_shift", static_cast<int>(c.freq_shift)},
          {"in_channels", c.in_channels},
          {"layers_per_block", c.layers_per_block.front()},
          {"mid_block_scale_factor", c.mid_block_scale_factor},
          {"mid_block_type", "UNetMidBlock2DCrossAttn"},
          {"norm_eps", c.norm_eps},
          {"norm_num_groups", c.norm_num_groups},
          {"out_channels", c.out_channels},
          {"sample_size", c.sample_size},
          {"transformer_layers_per_block", c.transformer_layers_per_block.front()},
          {"up_block_types", c.up_block_types},
          {"use_linear_projection", c.use_linear_projection}};
}

json clip_config_json(const models::CLIPTextConfig& c) {
  return {{"architectures", {"CLIPTextModel"}},
          {"model_type", "clip_text_model"},
          {"attention_dropout", 0.0},
          {"bos_token_id", 49406},
          {"dropout", 0.0},
          {"eos_token_id", c.eos_token_id},
          {"hidden_act", c.hidden_act},
          {"hidden_size", c.hidden_size},
          {"initializer_factor", 1.0},
          {"initializer_range", 0.02},
          {"intermediate_size", c.intermediate_size},
          {"layer_norm_eps", c.layer_norm_eps},
          {"max_position_embeddings", c.max_position_embeddings},
          {"num_attention_heads", c.num_attention_heads},
          {"num_hidden_layers", c.num_hidden_layers},
          {"pad_token_id", 1},
          {"projection_dim", c.projection_dim},
          {"torch_dtype", "float16"},
          {"vocab_size", c.vocab_size}};
}

// clip_grad_norm_ without its host sync: the GPU never waits for the CPU to read the norm.
void clip_gradients(const std::vector<at::Tensor>& params, double max_norm) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return;
  const auto norms = at::_foreach_norm(grads, 2);
  const auto total = at::stack(norms).norm();
  at::_foreach_mul_(grads, at::clamp_max(max_norm / (total + 1e-6), 1.0));
}

std::vector<std::pair<std::string, at::Tensor>> named_tensors(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  for (const auto& b : m.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

}  // namespace

ModelConfig ModelConfig::preset(const std::string& name) {
  ModelConfig m;
  auto& u = m.unet;
  auto& t = m.text;
  u.in_channels = u.out_channels = 32;
  u.sample_size = 16;
  t.vocab_size = 49408;
  t.max_position_embeddings = 77;
  t.hidden_act = "quick_gelu";
  if (name == "emoji") {
    // 18.0 M + 7.5 M parameters: 51 MB in fp16, the TAEF2 and tokenizer files making 58 MB.
    u.block_out_channels = {64, 160, 256};
    u.down_block_types = {"DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"};
    u.up_block_types = {"CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"};
    u.layers_per_block = {1, 1, 1};
    u.num_attention_heads = {4, 4, 4};
    u.norm_num_groups = 32;
    t.hidden_size = 128, t.intermediate_size = 512, t.projection_dim = 128, t.num_hidden_layers = 6;
    t.num_attention_heads = 4;
  } else if (name == "tiny") {
    u.block_out_channels = {32, 64};
    u.down_block_types = {"CrossAttnDownBlock2D", "DownBlock2D"};
    u.up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D"};
    u.layers_per_block = {1, 1};
    u.num_attention_heads = {2, 2};
    u.norm_num_groups = 8;
    t.hidden_size = 32, t.intermediate_size = 64, t.projection_dim = 32, t.num_hidden_layers = 1;
    t.num_attention_heads = 2;
  } else {
    throw Error("model preset '" + name + "' is not emoji or tiny");
  }
  const auto n = u.block_out_channels.size();
  u.cross_attention_dim.assign(n, t.hidden_size);
  u.transformer_layers_per_block.assign(n, 1);
  u.reverse_transformer_layers_per_block.assign(n, 1);
  return m;
}

FusedAdamW::FusedAdamW(std::vector<at::Tensor> params, double beta1, double beta2, double weight_decay, double eps)
    : params_(std::move(params)), beta1_(beta1), beta2_(beta2), weight_decay_(weight_decay), eps_(eps) {
  at::NoGradGuard no_grad;
  for (const auto& p : params_) {
    exp_avg_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    exp_avg_sq_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    // The kernel reads the step count from a float tensor on the parameter's device.
    steps_.push_back(at::zeros({}, p.options().dtype(at::kFloat)));
  }
}

void FusedAdamW::step(double lr) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> p, g, m, v, t;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad().defined()) continue;
    p.push_back(params_[i]);
    g.push_back(params_[i].grad());
    m.push_back(exp_avg_[i]);
    v.push_back(exp_avg_sq_[i]);
    t.push_back(steps_[i]);
  }
  if (p.empty()) return;
  at::_foreach_add_(t, 1);
  at::_fused_adamw_(p, g, m, v, {}, t, lr, beta1_, beta2_, weight_decay_, eps_, /*amsgrad=*/false, /*maximize=*/false);
}

void FusedAdamW::zero_grad() {
  for (auto& p : params_) p.mutable_grad().reset();
}

void FusedAdamW::save(torch::serialize::OutputArchive& archive) const {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    archive.write("adamw.exp_avg." + std::to_string(i), exp_avg_[i], /*is_buffer=*/true);
    archive.write("adamw.exp_avg_sq." + std::to_string(i), exp_avg_sq_[i], true);
    archive.write("adamw.step." + std::to_string(i), steps_[i], true);
  }
}

void FusedAdamW::load(torch::serialize::InputArchive& archive) {
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    for (auto* state : {&exp_avg_, &exp_avg_sq_, &steps_}) {
      const char* name = state == &exp_avg_ ? "exp_avg" : state == &exp_avg_sq_ ? "exp_avg_sq" : "step";
      at::Tensor t;
      archive.read(std::string("adamw.") + name + "." + std::to_string(i), t, /*is_buffer=*/true);
      if (!t.sizes().equals((*state)[i].sizes()))
        throw Error(std::string("checkpoint: AdamW ") + name + " of parameter " + std::to_string(i) + " has the wrong shape");
      (*state)[i].copy_(t);
    }
  }
}

schedulers::SchedulerConfig NoiseSchedule::config() {
  schedulers::SchedulerConfig c;
  c.num_train_timesteps = kTrainSteps;
  c.beta_start = kBetaStart;
  c.beta_end = kBetaEnd;
  c.beta_schedule = "scaled_linear";
  c.prediction_type = schedulers::Prediction::VPrediction;
  c.timestep_spacing = schedulers::Spacing::Trailing;
  c.steps_offset = 0;
  c.rescale_betas_zero_snr = true;
  return c;
}

NoiseSchedule::NoiseSchedule() {
  const auto ac = schedulers::alphas_cumprod(config());
  alphas_cumprod = at::tensor(ac, at::kDouble);
  float_ = alphas_cumprod.to(at::kFloat);
}

void NoiseSchedule::to(const at::Device& device) { float_ = alphas_cumprod.to(device, at::kFloat); }

at::Tensor NoiseSchedule::alphas_at(const at::Tensor& t) const { return float_.to(t.device()).index_select(0, t.to(at::kLong)); }

std::pair<at::Tensor, at::Tensor> NoiseSchedule::coefficients(const at::Tensor& x0, const at::Tensor& t) const {
  const auto ac = alphas_at(t.to(x0.device()));
  const auto shape = std::vector<int64_t>{t.size(0), 1, 1, 1};
  return {ac.sqrt().view(shape), (1 - ac).sqrt().view(shape)};
}

at::Tensor NoiseSchedule::add_noise(const at::Tensor& x0, const at::Tensor& noise, const at::Tensor& t) const {
  const auto [signal, sigma] = coefficients(x0, t);
  return signal * x0 + sigma * noise;
}

at::Tensor NoiseSchedule::velocity(const at::Tensor& x0, const at::Tensor& noise, const at::Tensor& t) const {
  const auto [signal, sigma] = coefficients(x0, t);
  return signal * noise - sigma * x0;
}

CaptionEncoder::CaptionEncoder(const text::CLIPTokenizer& tokenizer) : tokenizer_(tokenizer) {}

at::Tensor CaptionEncoder::ids(const std::vector<std::string>& captions) {
  const int64_t len = tokenizer_.max_length();
  auto out = at::empty({static_cast<int64_t>(captions.size()), len}, at::kLong);
  auto* dst = out.data_ptr<int64_t>();
  for (std::size_t i = 0; i < captions.size(); ++i) {
    auto it = cache_.find(captions[i]);
    if (it == cache_.end()) {
      if (cache_.size() >= 200000) cache_.clear();  // settings make millions of distinct captions
      const auto tok = tokenizer_.tokenize(captions[i]);
      it = cache_.emplace(captions[i], std::vector<int64_t>(tok.ids.begin(), tok.ids.end())).first;
    }
    std::copy(it->second.begin(), it->second.end(), dst + static_cast<int64_t>(i) * len);
  }
  return out;
}

ModelConfig ModelConfig::from_folder(const fs::path& dir) {
  ModelConfig m;
  m.unet = models::UNet2DConditionConfig::from_json(dir / "unet" / "config.json");
  m.text = models::CLIPTextConfig::from_json(dir / "text_encoder" / "config.json");
  return m;
}

Trainer::Trainer(TrainConfig config)
    : config_(std::move(config)),
      model_config_(config_.base.empty() ? ModelConfig::preset(config_.model) : ModelConfig::from_folder(config_.base)),
      rng_(config_.seed) {
  device_ = parse_train_device(config_.device);
  if (config_.batch < 1) throw Error("batch " + std::to_string(config_.batch) + " must be at least 1");
  if (!(config_.lr > 0)) throw Error("learning rate must be positive");
  if (config_.ema_decay < 0 || config_.ema_decay >= 1) throw Error("EMA decay must be in [0, 1)");
  if (config_.cfg_dropout < 0 || config_.cfg_dropout > 1) throw Error("CFG dropout must be in [0, 1]");
  if (config_.autocast != "auto" && config_.autocast != "on" && config_.autocast != "off")
    throw Error("autocast '" + config_.autocast + "' is not auto, on or off");
  if (config_.lora_rank < 0) throw Error("LoRA rank " + std::to_string(config_.lora_rank) + " must be positive");
  if (config_.lora_rank > 0 && config_.base.empty())
    throw Error("a LoRA trains on a trained model: give the model folder to start from (--base)");
  if (config_.inpaint && config_.base.empty())
    throw Error("an inpainting model is fine-tuned from a trained one: give the model folder to start from (--base)");
  if (config_.inpaint && config_.lora_rank > 0) throw Error("train either an inpainting model or a LoRA, not both");
  auto& unet_config = model_config_.unet;
  if (config_.inpaint && unet_config.in_channels == unet_config.out_channels)
    unet_config.in_channels = 2 * unet_config.out_channels + 1;
  const auto& styles = scene_styles();
  if (std::find(styles.begin(), styles.end(), config_.style) == styles.end())
    throw Error("style '" + config_.style + "' is not outline (or empty: the emoji as drawn)");
  at::manual_seed(config_.seed);
  unet_ = models::UNet2DConditionModel(model_config_.unet);
  text_encoder_ = models::CLIPTextModel(model_config_.text);
  // LibTorch's default init from the global generator, in construction order: the values (and
  // the generator state the later draws start from) of runs made before layers stopped
  // initialising themselves.
  models::init_random(*unet_);
  models::init_random(*text_encoder_);
  {
    // Zero-initialised output convolutions, as is usual for diffusion UNets, start from "predict zero".
    at::NoGradGuard no_grad;
    unet_->conv_out->weight.zero_();
    unet_->conv_out->bias.zero_();
    for (auto& p : text_encoder_->named_parameters())
      if (p.key().find("embedding") != std::string::npos) p.value().normal_(0, 0.02);
  }
  if (!config_.base.empty()) load_base(config_.base);
  unet_->to(device_);
  text_encoder_->to(device_);
  if (config_.lora_rank > 0) attach_lora();
  if (config_.inpaint)
    for (auto& p : text_encoder_->parameters()) p.requires_grad_(false);
  unet_->train();
  text_encoder_->train();
  if (device_.is_cuda()) {
    at::globalContext().setAllowTF32CuBLAS(true);
    at::globalContext().setAllowTF32CuDNN(true);
    at::globalContext().setBenchmarkCuDNN(true);
  }
  for (const auto& p : parameters()) ema_.push_back(p.detach().clone());
  optimizer_ = std::make_unique<FusedAdamW>(parameters(), 0.9, 0.99, config_.weight_decay);
  schedule_.to(device_);
}

Trainer::~Trainer() = default;

bool Trainer::autocast_on() const { return config_.autocast == "on" || (config_.autocast == "auto" && device_.is_cuda()); }

std::vector<std::pair<std::string, at::Tensor>> Trainer::named_trainables() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (!lora_.empty()) {
    for (const auto& a : lora_) {
      out.emplace_back("lora." + a.module + ".down", a.down);
      out.emplace_back("lora." + a.module + ".up", a.up);
    }
    return out;
  }
  for (const auto& p : unet_->named_parameters()) out.emplace_back("unet." + p.key(), p.value());
  // An inpainting fine-tune keeps the base's text encoder, so that its folder can share it.
  if (!config_.inpaint)
    for (const auto& p : text_encoder_->named_parameters()) out.emplace_back("text." + p.key(), p.value());
  return out;
}

std::vector<at::Tensor> Trainer::parameters() const {
  std::vector<at::Tensor> p;
  for (auto& [name, t] : named_trainables()) p.push_back(t);
  return p;
}

void Trainer::load_base(const fs::path& dir) {
  const auto unet_file = dir / "unet" / "diffusion_pytorch_model.safetensors";
  const auto text_file = dir / "text_encoder" / "model.safetensors";
  auto unet_weights = io::load_state_dict(unet_file);
  auto& conv_in = unet_weights["conv_in.weight"];
  const auto wanted = unet_->conv_in->weight.size(1);
  if (conv_in.defined() && conv_in.dim() == 4 && conv_in.size(1) < wanted) {
    // A text-to-image UNet becoming an inpainting one: the mask and masked-image channels start
    // with zero weights, so the fine-tune starts from the base model's predictions.
    auto widened = at::zeros({conv_in.size(0), wanted, conv_in.size(2), conv_in.size(3)}, conv_in.options());
    widened.narrow(1, 0, conv_in.size(1)).copy_(conv_in);
    conv_in = widened;
  }
  io::bind(*unet_, unet_weights, unet_file.string());
  io::bind(*text_encoder_, io::load_state_dict(text_file), text_file.string());
  const auto vae = io::JsonFile::read(dir / "vae" / "config.json");
  latent_scale_ = vae.required<double>("scaling_factor");
}

void Trainer::attach_lora() {
  at::NoGradGuard no_grad;
  for (auto& p : unet_->parameters()) p.requires_grad_(false);
  for (auto& p : text_encoder_->parameters()) p.requires_grad_(false);
  // The transformer blocks' projections, where LoRAs for SD usually sit (diffusers' and kohya's
  // default targets): attention q / k / v / out and the feed-forward's two layers.
  static const std::vector<std::string> targets = {".to_q", ".to_k", ".to_v", ".to_out.0", ".ff.net.0.proj", ".ff.net.2"};
  const auto r = config_.lora_rank;
  for (const auto& m : unet_->named_modules()) {
    auto* linear = dynamic_cast<models::LinearImpl*>(m.value().get());
    if (!linear) continue;
    const auto& name = m.key();
    const bool target = std::any_of(targets.begin(), targets.end(), [&](const std::string& t) {
      return name.size() > t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0;
    });
    if (!target) continue;
    LoraAdapter a;
    a.module = name;
    a.linear = linear;
    a.base = linear->weight.detach();
    const auto in = a.base.size(1), out = a.base.size(0);
    // PEFT's initialisation: down as nn.Linear's (kaiming_uniform, a = sqrt(5)), up zero, so
    // training starts from the base model exactly.
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    a.down = at::empty({r, in}, a.base.options().dtype(at::kFloat)).uniform_(-bound, bound).requires_grad_();
    a.up = at::zeros({out, r}, a.base.options().dtype(at::kFloat)).requires_grad_();
    lora_.push_back(std::move(a));
  }
  if (lora_.empty()) throw Error("the base UNet has no attention or feed-forward layers to adapt");
  log::get("train").info(log::str("LoRA of rank ", r, " on ", lora_.size(), " UNet layers"));
}

void Trainer::patch_lora() {
  for (auto& a : lora_) a.linear->weight = a.base + at::mm(a.up, a.down).to(a.base.scalar_type());
}

at::Tensor Trainer::forward_loss(const at::Tensor& latents, const at::Tensor& ids, at::Tensor noise, at::Tensor timesteps,
                                 const at::Tensor& extra) {
  const int64_t b = latents.size(0);
  auto x0 = latents.to(device_, at::kFloat);
  if (!noise.defined()) noise = at::randn_like(x0);
  if (!timesteps.defined()) timesteps = at::randint(0, NoiseSchedule::kTrainSteps, {b}, at::TensorOptions(at::kLong).device(device_));
  patch_lora();
  noise = noise.to(device_, at::kFloat);
  timesteps = timesteps.to(device_, at::kLong);
  const auto xt = schedule_.add_noise(x0, noise, timesteps);
  at::Tensor pred;
  {
    AutocastGuard autocast(autocast_on(), device_.type());
    models::UNetConditioning cond;
    cond.encoder_hidden_states = text_encoder_->forward(ids.to(device_)).last_hidden_state;
    const auto input = extra.defined() ? at::cat({xt, extra.to(device_, at::kFloat)}, 1) : xt;
    pred = unet_->forward(input, timesteps.to(at::kFloat), cond);
  }
  auto err = (pred.to(at::kFloat) - schedule_.velocity(x0, noise, timesteps)).pow(2).mean({1, 2, 3});
  if (config_.min_snr_gamma > 0) {
    // The v error is the x0 error over sigma^2 = 1 / (SNR + 1): weighting x0 by clamp(SNR, 1,
    // gamma) is Min-SNR-gamma (Hang et al. 2023) above SNR 1 and "truncated SNR" (Salimans & Ho
    // 2022) below it, so the near-pure-noise steps that set the background keep their full weight.
    const auto ac = schedule_.alphas_at(timesteps);
    const auto snr = ac / (1 - ac);
    err = err * at::clamp(snr, 1.0, config_.min_snr_gamma) / (snr + 1);
  }
  return err.mean();
}

double Trainer::lr_at(double progress, int64_t step) const {
  const double p = std::clamp(progress, 0.0, 1.0);
  const double cosine = config_.min_lr_ratio + (1 - config_.min_lr_ratio) * 0.5 * (1 + std::cos(M_PI * p));
  const double warm = config_.warmup > 0 ? std::min(1.0, static_cast<double>(step + 1) / config_.warmup) : 1.0;
  return config_.lr * warm * cosine;
}

void Trainer::update_ema() {
  at::NoGradGuard no_grad;
  const double d = std::min(config_.ema_decay, (1.0 + step_) / (10.0 + step_));
  at::_foreach_lerp_(ema_, parameters(), 1.0 - d);
}

double Trainer::step(const at::Tensor& latents, const at::Tensor& ids, const at::Tensor& noise, const at::Tensor& timesteps,
                     const at::Tensor& extra) {
  optimizer_->zero_grad();
  auto l = forward_loss(latents, ids, noise, timesteps, extra);
  l.backward();
  if (config_.grad_clip > 0) clip_gradients(parameters(), config_.grad_clip);
  const double progress = config_.steps > 0 ? static_cast<double>(step_) / config_.steps : 0.0;
  optimizer_->step(lr_at(progress, step_));
  update_ema();
  ++step_;
  return l.item<double>();
}

double Trainer::loss(const at::Tensor& latents, const at::Tensor& ids, const at::Tensor& noise, const at::Tensor& timesteps,
                     const at::Tensor& extra) {
  at::NoGradGuard no_grad;
  return forward_loss(latents, ids, noise, timesteps, extra).item<double>();
}

void Trainer::save_checkpoint(const fs::path& dir) const {
  fs::create_directories(dir);
  torch::serialize::OutputArchive model;
  for (const auto& [name, t] : named_trainables()) model.write(name, t);
  for (std::size_t i = 0; i < ema_.size(); ++i) model.write("ema." + std::to_string(i), ema_[i]);
  optimizer_->save(model);
  model.save_to((dir / "model.pt.tmp").string());
  std::ostringstream rng;
  rng << rng_;
  write_json(dir / "state.json.tmp", {{"step", step_}, {"seconds", seconds_}, {"latent_scale", latent_scale_},
                                      {"model", config_.model}, {"rng", rng.str()}});
  for (const char* f : {"model.pt", "state.json"}) fs::rename(dir / (std::string(f) + ".tmp"), dir / f);
}

void Trainer::load_checkpoint(const fs::path& dir) {
  std::ifstream in(dir / "state.json");
  if (!in) throw Error((dir / "state.json").string() + ": no checkpoint to resume");
  const auto state = json::parse(in);
  if (state.at("model").get<std::string>() != config_.model)
    throw Error(dir.string() + ": checkpoint of model '" + state.at("model").get<std::string>() + "', not '" +
                config_.model + "'");
  torch::serialize::InputArchive model;
  model.load_from((dir / "model.pt").string(), device_);
  at::NoGradGuard no_grad;
  for (auto& [name, p] : named_trainables()) {
    at::Tensor t;
    model.read(name, t);
    p.copy_(t);
  }
  for (std::size_t i = 0; i < ema_.size(); ++i) {
    at::Tensor t;
    model.read("ema." + std::to_string(i), t);
    ema_[i].copy_(t);
  }
  optimizer_->load(model);
  step_ = state.at("step").get<int64_t>();
  seconds_ = state.at("seconds").get<double>();
  latent_scale_ = state.at("latent_scale").get<double>();
  std::istringstream rng(state.at("rng").get<std::string>());
  rng >> rng_;
}

namespace {

LatentBank encode_bank(const SceneComposer& composer, models::TAESD& taesd, int64_t limit, int64_t chunk,
                       bool autocast, std::uint64_t seed) {
  LatentBank bank;
  bank.specs = composer.all();
  std::mt19937_64 rng(seed);
  // Shuffled so that each chunk (which shares one jitter draw per placement) mixes every setting.
  std::shuffle(bank.specs.begin(), bank.specs.end(), rng);
  if (limit > 0 && limit < static_cast<int64_t>(bank.specs.size())) bank.specs.resize(static_cast<std::size_t>(limit));
  const auto n = static_cast<int64_t>(bank.specs.size());
  if (n == 0) throw Error("no training scenes: every combination of the atlas is held out");
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> parts;
  for (int64_t begin = 0; begin < n; begin += chunk) {
    const std::vector<SceneSpec> specs(bank.specs.begin() + begin, bank.specs.begin() + std::min(n, begin + chunk));
    const auto images = composer.render(specs, &rng);
    AutocastGuard guard(autocast, images.device().type());
    parts.push_back(taesd->encode(images * 2 - 1).to(at::kBFloat16));
  }
  bank.latents = at::cat(parts);
  return bank;
}

// The next batch's bank rows and token ids, made on a worker thread while the device trains.
struct HostBatch {
  at::Tensor rows;  // [B] long: bank rows
  std::vector<SceneSpec> specs;  // or the scenes to render (inpainting)
  at::Tensor ids;   // [B, 77] long
};

// An inpainting batch made on the device: scenes rendered with `rng`'s jitter, masks painted on
// them, and both the scene and the scene with the mask's pixels blanked (0 in [-1, 1], as
// diffusers' inpainting pipelines blank them) encoded. Returns the scaled latents and the UNet's
// extra input [B, 1 + C, h, w]: the mask at latent size (nearest, as the pipelines resize it)
// and the masked scene's latents.
std::pair<at::Tensor, at::Tensor> inpainting_batch(const SceneComposer& composer, models::TAESD& taesd,
                                                   const std::vector<SceneSpec>& specs, std::mt19937_64& rng,
                                                   double scale, bool autocast) {
  at::NoGradGuard no_grad;
  const auto images = composer.render(specs, &rng);
  const auto masks = composer.inpainting_masks(images, specs, rng);
  const auto pixels = images * 2 - 1;
  at::Tensor latents;
  {
    AutocastGuard guard(autocast, images.device().type());
    latents = taesd->encode(at::cat({pixels, pixels * masks.lt(0.5)})).to(at::kFloat) * scale;
  }
  const auto n = images.size(0);
  const auto z = latents.narrow(0, 0, n), masked = latents.narrow(0, n, n);
  const auto small = at::upsample_nearest2d(masks, {z.size(2), z.size(3)});
  return {z, at::cat({small, masked}, 1)};
}

}  // namespace

TrainSummary Trainer::train() {
  auto log = log::get("train");
  if (config_.out.empty()) throw Error("training needs an output folder (--out)");
  if (config_.steps <= 0 && config_.minutes <= 0) throw Error("training needs a budget: --steps and/or --minutes");
  if (config_.bank_scenes < 0) throw Error("bank scenes must be 0 (every combination) or more");
  fs::create_directories(config_.out);
  const auto tokenizer = text::CLIPTokenizer::from_openai_bpe(config_.bpe);
  CaptionEncoder captions(tokenizer);
  const auto atlas = SpriteAtlas::load(config_.atlas, config_.atlas_limit);
  if (config_.holdout.empty()) throw Error("training needs the hold-out list (--holdout)");
  auto holdout = HoldOut::load(config_.holdout, atlas);
  SceneOptions scene_options;
  scene_options.style = config_.style;
  SceneComposer composer(atlas, std::move(holdout), scene_options, device_);
  auto taesd = models::load_taesd(config_.taesd);
  if (!taesd->has_encoder() || taesd->config.latent_channels != model_config_.unet.out_channels)
    throw Error(config_.taesd.string() + ": needs a TAESD encoder with " + std::to_string(model_config_.unet.out_channels) +
                " latent channels (TAEF2)");
  taesd->to(device_);
  taesd->eval();

  // The bank comes from its own seed, so a resumed run trains on the same latents. Inpainting
  // renders and encodes every batch instead: each scene needs its own mask and masked image.
  LatentBank bank;
  int64_t bank_rows = 0;
  if (!config_.inpaint) {
    const auto bank_start = Clock::now();
    bank = encode_bank(composer, taesd, config_.bank_scenes, std::min<int64_t>(1024, std::max<int64_t>(config_.batch, 64)),
                       autocast_on(), config_.seed ^ 0x5eedba4cULL);
    taesd = nullptr;
    bank_rows = static_cast<int64_t>(bank.specs.size());
    log.info(log::str("encoded ", bank_rows, " scenes once in ", seconds_since(bank_start), " s (",
                      static_cast<double>(bank.latents.nbytes()) / (1 << 30), " GiB of bf16 latents)"));
  }
  std::mt19937_64 scene_rng(config_.seed ^ 0x1a9a1d7ULL ^ static_cast<std::uint64_t>(step_));

  const auto ckpt = config_.out / "checkpoint";
  if (config_.resume && fs::exists(ckpt / "state.json")) {
    load_checkpoint(ckpt);
    log.info(log::str("resumed at step ", step_, " after ", static_cast<int>(seconds_), " s of training"));
  } else if (!config_.base.empty()) {
    log.info(log::str("the base model's latent scale: ", latent_scale_));
  } else {
    // Unit second moment for the diffusion latents: the scale diffusers calls scaling_factor.
    // In slices: a float copy of the whole bank would double its memory for a moment.
    auto sum = at::zeros({}, at::TensorOptions(at::kDouble).device(device_)), sum2 = sum.clone();
    for (int64_t begin = 0; begin < bank_rows; begin += 16384) {
      const auto z = bank.latents.narrow(0, begin, std::min<int64_t>(16384, bank_rows - begin)).to(at::kDouble);
      sum += z.sum();
      sum2 += z.pow(2).sum();
    }
    const double count = static_cast<double>(bank.latents.numel());
    const double mean = sum.item<double>() / count, rms = std::sqrt(sum2.item<double>() / count);
    latent_scale_ = 1.0 / rms;
    log.info(log::str("TAEF2 latents over ", bank_rows, " scenes: mean ", mean, ", rms ", rms, " -> scaling_factor ",
                      latent_scale_));
  }

  std::ofstream csv(config_.out / "loss.csv", config_.resume ? std::ios::app : std::ios::trunc);
  if (!csv) throw Error((config_.out / "loss.csv").string() + ": cannot write");
  if (!config_.resume || step_ == 0) csv << "step,loss,lr,seconds,images_per_second\n";
  const double schedule_seconds =
      (config_.schedule_minutes > 0 ? config_.schedule_minutes : config_.minutes) * 60.0;
  const int64_t start_step = step_;

  auto make_batch = [&]() {
    std::uniform_real_distribution<double> u(0.0, 1.0);
    HostBatch b;
    std::vector<std::string> text;
    text.reserve(static_cast<std::size_t>(config_.batch));
    if (config_.inpaint) {
      b.specs = composer.sample(config_.batch, rng_);
    } else {
      b.rows = at::empty({config_.batch}, at::kLong);
      auto* r = b.rows.data_ptr<int64_t>();
      for (int64_t i = 0; i < config_.batch; ++i) {
        r[i] = static_cast<int64_t>(rng_() % static_cast<std::uint64_t>(bank_rows));
        b.specs.push_back(bank.specs[static_cast<std::size_t>(r[i])]);
      }
    }
    for (const auto& spec : b.specs)
      text.push_back(u(rng_) < config_.cfg_dropout ? std::string() : composer.sample_caption(spec, rng_));
    b.ids = captions.ids(text);
    if (device_.is_cuda()) {
      if (b.rows.defined()) b.rows = b.rows.pin_memory();
      b.ids = b.ids.pin_memory();
    }
    return b;
  };
  // rng_ is only touched by the worker while a batch is in flight; joined before checkpoints.
  auto next = std::async(std::launch::async, make_batch);

  const auto run_start = Clock::now();
  auto window_start = Clock::now();
  auto loss_sum = at::zeros({}, at::TensorOptions(at::kFloat).device(device_));
  int64_t window = 0;
  double waited = 0;  // seconds the loop waited for host batches in this log window
  TrainSummary summary;
  const double seconds_before = seconds_;
  while (true) {
    const double run_seconds = seconds_since(run_start);
    if (config_.steps > 0 && step_ - start_step >= config_.steps) break;
    if (config_.minutes > 0 && run_seconds >= config_.minutes * 60.0) break;
    seconds_ = seconds_before + run_seconds;
    double progress = 0;
    if (config_.schedule_steps > 0)
      progress = static_cast<double>(step_) / config_.schedule_steps;
    else if (schedule_seconds > 0)
      progress = seconds_ / schedule_seconds;
    else if (config_.steps > 0)
      progress = static_cast<double>(step_ - start_step) / config_.steps;
    const double lr = lr_at(progress, step_);

    const auto wait_start = Clock::now();
    auto batch = next.get();
    waited += seconds_since(wait_start);
    next = std::async(std::launch::async, make_batch);
    auto ids = batch.ids.to(device_, /*non_blocking=*/true);
    at::Tensor z, extra;
    if (config_.inpaint)
      std::tie(z, extra) = inpainting_batch(composer, taesd, batch.specs, scene_rng, latent_scale_, autocast_on());
    else
      z = bank.latents.index_select(0, batch.rows.to(device_, /*non_blocking=*/true)).to(at::kFloat) * latent_scale_;

    optimizer_->zero_grad();
    auto l = forward_loss(z, ids, {}, {}, extra);
    l.backward();
    if (config_.grad_clip > 0) clip_gradients(parameters(), config_.grad_clip);
    optimizer_->step(lr);
    update_ema();
    ++step_;
    loss_sum += l.detach();
    ++window;
    if (step_ % config_.log_every == 0) {
      const double mean = loss_sum.item<double>() / static_cast<double>(window);
      const double elapsed = seconds_since(window_start);
      const double ips = static_cast<double>(window * config_.batch) / elapsed;
      csv << step_ << ',' << mean << ',' << lr << ',' << std::fixed << std::setprecision(1)
          << seconds_before + seconds_since(run_start) << ',' << ips << std::defaultfloat << std::setprecision(6) << '\n';
      csv.flush();
      log.info(log::str("step ", step_, "  loss ", mean, "  lr ", lr, "  ", static_cast<int>(ips), " images/s  (",
                        static_cast<int>(100 * waited / elapsed), "% waiting for host batches)"));
      summary.last_loss = mean;
      loss_sum.zero_();
      window = 0;
      waited = 0;
      window_start = Clock::now();
    }
  }
  next.wait();
  if (window > 0) summary.last_loss = loss_sum.item<double>() / static_cast<double>(window);
  seconds_ = seconds_before + seconds_since(run_start);
  summary.steps = step_;
  summary.run_steps = step_ - start_step;
  summary.seconds = seconds_;
  summary.images_per_second = static_cast<double>(summary.run_steps * config_.batch) / seconds_since(run_start);
  summary.latent_scale = latent_scale_;
  save_checkpoint(ckpt);
  write_json(config_.out / "summary.json",
             {{"model", config_.model}, {"steps", summary.steps}, {"run_steps", summary.run_steps},
              {"training_seconds", summary.seconds}, {"images_per_second", summary.images_per_second},
              {"last_loss", summary.last_loss}, {"latent_scale", latent_scale_}, {"batch", config_.batch},
              {"lr", config_.lr}, {"device", config_.device}, {"sprites", atlas.size()}, {"bank_scenes", bank_rows}});
  log.info(log::str("trained ", summary.run_steps, " steps (", summary.steps, " in all) at ",
                    static_cast<int>(summary.images_per_second), " images/s; checkpoint in ", ckpt.string()));
  if (config_.export_model) {
    if (lora_.empty())
      export_diffusers(config_.out / "model");
    else
      export_lora(config_.out / "lora.safetensors");
  }
  return summary;
}

void Trainer::export_lora(const fs::path& file) const {
  if (lora_.empty()) throw Error("this run trains the whole model, not a LoRA: export_diffusers");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  // ema_ follows named_trainables(): down, up per adapter.
  for (std::size_t i = 0; i < lora_.size(); ++i) {
    tensors.emplace_back("unet." + lora_[i].module + ".lora_A.weight", ema_[2 * i].to(at::kHalf));
    tensors.emplace_back("unet." + lora_[i].module + ".lora_B.weight", ema_[2 * i + 1].to(at::kHalf));
  }
  if (file.has_parent_path()) fs::create_directories(file.parent_path());
  io::write_safetensors(file, tensors, {{"format", "pt"}});
  log::get("train").info(log::str("exported the EMA LoRA (", lora_.size(), " layers, rank ", config_.lora_rank, ") to ",
                                  file.string()));
}

void Trainer::export_diffusers(const fs::path& dir) const {
  if (!lora_.empty()) throw Error("this run trains a LoRA: export_lora");
  fs::create_directories(dir);
  for (const char* sub : {"unet", "text_encoder", "tokenizer", "scheduler", "vae"}) fs::create_directories(dir / sub);
  // The EMA weights, in the order parameters() lists them.
  std::size_t i = 0;
  auto take = [&](const torch::nn::Module& m, bool trained) {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), (trained ? ema_[i++] : p.value()).to(at::kHalf));
    for (const auto& b : m.named_buffers()) out.emplace_back(b.key(), b.value().to(at::kHalf));
    return out;
  };
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  io::write_safetensors(dir / "unet" / "diffusion_pytorch_model.safetensors", take(*unet_, true), meta);
  io::write_safetensors(dir / "text_encoder" / "model.safetensors", take(*text_encoder_, !config_.inpaint), meta);
  write_json(dir / "unet" / "config.json", unet_config_json(model_config_.unet));
  write_json(dir / "text_encoder" / "config.json", clip_config_json(model_config_.text));
  text::CLIPTokenizer::write_folder_from_openai_bpe(config_.bpe, dir / "tokenizer");
  const auto sc = NoiseSchedule::config();
  write_json(dir / "scheduler" / "scheduler_config.json",
             {{"_class_name", "EulerDiscreteScheduler"}, {"_diffusers_version", "0.42.1"},
              {"beta_end", sc.beta_end}, {"beta_schedule", sc.beta_schedule}, {"beta_start", sc.beta_start},
              {"interpolation_type", "linear"}, {"num_train_timesteps", sc.num_train_timesteps},
              {"prediction_type", schedulers::prediction_name(sc.prediction_type)},
              {"rescale_betas_zero_snr", sc.rescale_betas_zero_snr}, {"steps_offset", sc.steps_offset},
              {"timestep_spacing", schedulers::spacing_name(sc.timestep_spacing)}, {"trained_betas", nullptr},
              {"use_karras_sigmas", false}});
  auto vae = models::load_taesd(config_.taesd);
  if (!vae->has_encoder() || !vae->has_decoder())
    throw Error(config_.taesd.string() + ": the exported model needs both the TAEF2 encoder and decoder");
  auto vae_tensors = named_tensors(*vae);
  for (auto& [name, t] : vae_tensors) t = t.to(at::kHalf);
  io::write_safetensors(dir / "vae" / "diffusion_pytorch_model.safetensors", vae_tensors, meta);
  const auto& vc = vae->config;
  write_json(dir / "vae" / "config.json",
             {{"_class_name", "AutoencoderTiny"}, {"_diffusers_version", "0.42.1"}, {"act_fn", "relu"},
              {"decoder_block_out_channels", vc.decoder_block_out_channels},
              {"encoder_block_out_channels", vc.encoder_block_out_channels}, {"force_upcast", false},
              {"in_channels", vc.in_channels}, {"latent_channels", vc.latent_channels},
              {"latent_magnitude", vc.latent_magnitude}, {"latent_shift", vc.latent_shift},
              {"num_decoder_blocks", vc.num_decoder_blocks}, {"num_encoder_blocks", vc.num_encoder_blocks},
              {"out_channels", vc.out_channels}, {"scaling_factor", latent_scale_}, {"shift_factor", 0.0},
              {"upsample_fn", "nearest"}, {"upsampling_scaling_factor", vc.upsampling_scaling_factor}});
  write_json(dir / "model_index.json",
             {{"_class_name", model_config_.unet.in_channels == model_config_.unet.out_channels
                                  ? "StableDiffusionPipeline" : "StableDiffusionInpaintPipeline"},
              {"_diffusers_version", "0.42.1"},
              {"feature_extractor", {nullptr, nullptr}}, {"image_encoder", {nullptr, nullptr}},
              {"requires_safety_checker", false}, {"safety_checker", {nullptr, nullptr}},
              {"scheduler", {"diffusers", "EulerDiscreteScheduler"}}, {"text_encoder", {"transformers", "CLIPTextModel"}},
              {"tokenizer", {"transformers", "CLIPTokenizer"}}, {"unet", {"diffusers", "UNet2DConditionModel"}},
              {"vae", {"diffusers", "AutoencoderTiny"}}});
  log::get("train").info("exported the EMA model to " + dir.string());
}

}  // namespace diffract::training
