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

#include "core/io/safetensors_writer.h"
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
    u.block_out_channels = {64, 128, 192};
    u.down_block_types = {"DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"};
    u.up_block_types = {"CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"};
    u.layers_per_block = {1, 1, 1};
    u.num_attention_heads = {4, 4, 4};
    u.norm_num_groups = 32;
    t.hidden_size = 96, t.intermediate_size = 384, t.projection_dim = 96, t.num_hidden_layers = 4;
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

NoiseSchedule::NoiseSchedule() {
  auto betas = at::linspace(std::sqrt(kBetaStart), std::sqrt(kBetaEnd), kTrainSteps, at::kDouble).pow(2);
  alphas_cumprod = at::cumprod(1 - betas, 0);
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

Trainer::Trainer(TrainConfig config)
    : config_(std::move(config)), model_config_(ModelConfig::preset(config_.model)), rng_(config_.seed) {
  device_ = parse_train_device(config_.device);
  if (config_.batch < 1) throw Error("batch " + std::to_string(config_.batch) + " must be at least 1");
  if (!(config_.lr > 0)) throw Error("learning rate must be positive");
  if (config_.ema_decay < 0 || config_.ema_decay >= 1) throw Error("EMA decay must be in [0, 1)");
  if (config_.cfg_dropout < 0 || config_.cfg_dropout > 1) throw Error("CFG dropout must be in [0, 1]");
  if (config_.autocast != "auto" && config_.autocast != "on" && config_.autocast != "off")
    throw Error("autocast '" + config_.autocast + "' is not auto, on or off");
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
  unet_->to(device_);
  text_encoder_->to(device_);
  unet_->train();
  text_encoder_->train();
  if (device_.is_cuda()) {
    at::globalContext().setAllowTF32CuBLAS(true);
    at::globalContext().setAllowTF32CuDNN(true);
    at::globalContext().setBenchmarkCuDNN(true);
  }
  for (const auto& p : parameters()) ema_.push_back(p.detach().clone());
  optimizer_ = std::make_unique<FusedAdamW>(parameters(), 0.9, 0.99, config_.weight_decay);
  alphas_cumprod_ = schedule_.alphas_cumprod.to(at::kFloat).to(device_);
}

Trainer::~Trainer() = default;

bool Trainer::autocast_on() const { return config_.autocast == "on" || (config_.autocast == "auto" && device_.is_cuda()); }

std::vector<at::Tensor> Trainer::parameters() const {
  auto p = unet_->parameters();
  for (auto& t : text_encoder_->parameters()) p.push_back(t);
  return p;
}

at::Tensor Trainer::forward_loss(const at::Tensor& latents, const at::Tensor& ids, at::Tensor noise, at::Tensor timesteps) {
  const int64_t b = latents.size(0);
  auto x0 = latents.to(device_, at::kFloat);
  if (!noise.defined()) noise = at::randn_like(x0);
  if (!timesteps.defined()) timesteps = at::randint(0, NoiseSchedule::kTrainSteps, {b}, at::TensorOptions(at::kLong).device(device_));
  noise = noise.to(device_, at::kFloat);
  timesteps = timesteps.to(device_, at::kLong);
  auto ac = alphas_cumprod_.index_select(0, timesteps).view({b, 1, 1, 1});
  auto xt = ac.sqrt() * x0 + (1 - ac).sqrt() * noise;
  at::Tensor pred;
  {
    AutocastGuard autocast(autocast_on(), device_.type());
    models::UNetConditioning cond;
    cond.encoder_hidden_states = text_encoder_->forward(ids.to(device_)).last_hidden_state;
    pred = unet_->forward(xt, timesteps.to(at::kFloat), cond);
  }
  auto err = (pred.to(at::kFloat) - noise).pow(2).mean({1, 2, 3});
  if (config_.min_snr_gamma > 0) {
    auto snr = ac.view({b}) / (1 - ac.view({b}));
    err = err * at::clamp_max(snr, config_.min_snr_gamma) / snr;
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

double Trainer::step(const at::Tensor& latents, const at::Tensor& ids, const at::Tensor& noise, const at::Tensor& timesteps) {
  optimizer_->zero_grad();
  auto l = forward_loss(latents, ids, noise, timesteps);
  l.backward();
  if (config_.grad_clip > 0) clip_gradients(parameters(), config_.grad_clip);
  const double progress = config_.steps > 0 ? static_cast<double>(step_) / config_.steps : 0.0;
  optimizer_->step(lr_at(progress, step_));
  update_ema();
  ++step_;
  return l.item<double>();
}

double Trainer::loss(const at::Tensor& latents, const at::Tensor& ids, const at::Tensor& noise, const at::Tensor& timesteps) {
  at::NoGradGuard no_grad;
  return forward_loss(latents, ids, noise, timesteps).item<double>();
}

void Trainer::save_checkpoint(const fs::path& dir) const {
  fs::create_directories(dir);
  torch::serialize::OutputArchive model;
  for (const auto& p : unet_->named_parameters()) model.write("unet." + p.key(), p.value());
  for (const auto& p : text_encoder_->named_parameters()) model.write("text." + p.key(), p.value());
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
  for (auto& p : unet_->named_parameters()) {
    at::Tensor t;
    model.read("unet." + p.key(), t);
    p.value().copy_(t);
  }
  for (auto& p : text_encoder_->named_parameters()) {
    at::Tensor t;
    model.read("text." + p.key(), t);
    p.value().copy_(t);
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
  at::Tensor rows;  // [B] long
  at::Tensor ids;   // [B, 77] long
};

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
  SceneComposer composer(atlas, std::move(holdout), {}, device_);
  auto taesd = models::load_taesd(config_.taesd);
  if (!taesd->has_encoder() || taesd->config.latent_channels != model_config_.unet.in_channels)
    throw Error(config_.taesd.string() + ": needs a TAESD encoder with " + std::to_string(model_config_.unet.in_channels) +
                " latent channels (TAEF2)");
  taesd->to(device_);
  taesd->eval();

  // The bank comes from its own seed, so a resumed run trains on the same latents.
  const auto bank_start = Clock::now();
  auto bank = encode_bank(composer, taesd, config_.bank_scenes, std::min<int64_t>(1024, std::max<int64_t>(config_.batch, 64)),
                          autocast_on(), config_.seed ^ 0x5eedba4cULL);
  taesd = nullptr;
  const auto bank_rows = static_cast<int64_t>(bank.specs.size());
  log.info(log::str("encoded ", bank_rows, " scenes once in ", seconds_since(bank_start), " s (",
                    static_cast<double>(bank.latents.nbytes()) / (1 << 30), " GiB of bf16 latents)"));

  const auto ckpt = config_.out / "checkpoint";
  if (config_.resume && fs::exists(ckpt / "state.json")) {
    load_checkpoint(ckpt);
    log.info(log::str("resumed at step ", step_, " after ", static_cast<int>(seconds_), " s of training"));
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
    b.rows = at::empty({config_.batch}, at::kLong);
    auto* r = b.rows.data_ptr<int64_t>();
    std::vector<std::string> text;
    text.reserve(static_cast<std::size_t>(config_.batch));
    for (int64_t i = 0; i < config_.batch; ++i) {
      r[i] = static_cast<int64_t>(rng_() % static_cast<std::uint64_t>(bank_rows));
      const auto& spec = bank.specs[static_cast<std::size_t>(r[i])];
      text.push_back(u(rng_) < config_.cfg_dropout ? std::string() : composer.sample_caption(spec, rng_));
    }
    b.ids = captions.ids(text);
    if (device_.is_cuda()) {
      b.rows = b.rows.pin_memory();
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
    auto z = bank.latents.index_select(0, batch.rows.to(device_, /*non_blocking=*/true)).to(at::kFloat) * latent_scale_;

    optimizer_->zero_grad();
    auto l = forward_loss(z, ids, {}, {});
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
  if (config_.export_model) export_diffusers(config_.out / "model");
  return summary;
}

void Trainer::export_diffusers(const fs::path& dir) const {
  fs::create_directories(dir);
  for (const char* sub : {"unet", "text_encoder", "tokenizer", "scheduler", "vae"}) fs::create_directories(dir / sub);
  // The EMA weights, in the order parameters() lists them.
  std::size_t i = 0;
  auto take = [&](const torch::nn::Module& m) {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), ema_[i++].to(at::kHalf));
    for (const auto& b : m.named_buffers()) out.emplace_back(b.key(), b.value().to(at::kHalf));
    return out;
  };
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  io::write_safetensors(dir / "unet" / "diffusion_pytorch_model.safetensors", take(*unet_), meta);
  io::write_safetensors(dir / "text_encoder" / "model.safetensors", take(*text_encoder_), meta);
  write_json(dir / "unet" / "config.json", unet_config_json(model_config_.unet));
  write_json(dir / "text_encoder" / "config.json", clip_config_json(model_config_.text));
  text::CLIPTokenizer::write_folder_from_openai_bpe(config_.bpe, dir / "tokenizer");
  write_json(dir / "scheduler" / "scheduler_config.json",
             {{"_class_name", "EulerDiscreteScheduler"}, {"_diffusers_version", "0.42.1"},
              {"beta_end", NoiseSchedule::kBetaEnd}, {"beta_schedule", "scaled_linear"},
              {"beta_start", NoiseSchedule::kBetaStart}, {"interpolation_type", "linear"},
              {"num_train_timesteps", NoiseSchedule::kTrainSteps}, {"prediction_type", "epsilon"},
              {"steps_offset", 1}, {"timestep_spacing", "leading"}, {"trained_betas", nullptr},
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
             {{"_class_name", "StableDiffusionPipeline"}, {"_diffusers_version", "0.42.1"},
              {"feature_extractor", {nullptr, nullptr}}, {"image_encoder", {nullptr, nullptr}},
              {"requires_safety_checker", false}, {"safety_checker", {nullptr, nullptr}},
              {"scheduler", {"diffusers", "EulerDiscreteScheduler"}}, {"text_encoder", {"transformers", "CLIPTextModel"}},
              {"tokenizer", {"transformers", "CLIPTokenizer"}}, {"unet", {"diffusers", "UNet2DConditionModel"}},
              {"vae", {"diffusers", "AutoencoderTiny"}}});
  log::get("train").info("exported the EMA model to " + dir.string());
}

}  // namespace diffract::training
