#include "core/pipeline/flux.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "core/io/diffusers_folder.h"
#include "core/io/upload.h"
#include "core/models/common/fp8_linear.h"
#include "core/models/autoencoders/autoencoder_kl.h"
#include "core/models/autoencoders/taesd.h"
#include "core/models/common/layers.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/models/text_encoders/t5_encoder.h"
#include "core/models/transformers/flux_transformer_2d.h"
#include "core/parallel/denoiser.h"
#include "core/parallel/pipefusion.h"
#include "core/parallel/strategy.h"
#include "core/pipeline/clip_graph.h"
#include "core/pipeline/kernel_profile.h"
#include "core/pipeline/pipeline_util.h"
#include "core/pipeline/prompt_encoding.h"
#include "core/pipeline/single_file.h"
#include "core/schedulers/sampler.h"
#include "core/text/clip_tokenizer.h"
#include "core/text/prompt_syntax.h"
#include "core/text/t5_tokenizer.h"
#include "core/util/error.h"
#include "core/util/graphed_function.h"
#include "core/util/log.h"
#include "core/util/options.h"

namespace diffract::pipeline {

namespace fs = std::filesystem;
using namespace detail;

namespace {

// Flux's 16 latent channels -> RGB for previews without a TAEF1: the least-squares factors and
// bias of ComfyUI's Flux latent format (comfy/latent_formats.py, class Flux), on the diffusion
// latents, giving [-1, 1] colours at latent resolution.
at::Tensor flux_latent_rgb(const at::Tensor& x0) {
  static const float factors[16][3] = {
      {-0.0346f, 0.0244f, 0.0681f},  {0.0034f, 0.0210f, 0.0687f},   {0.0275f, -0.0668f, -0.0433f},
      {-0.0174f, 0.0160f, 0.0617f},  {0.0859f, 0.0721f, 0.0329f},   {0.0004f, 0.0383f, 0.0115f},
      {0.0405f, 0.0861f, 0.0915f},   {-0.0236f, -0.0185f, -0.0259f}, {-0.0245f, 0.0250f, 0.1180f},
      {0.1008f, 0.0755f, -0.0421f},  {-0.0515f, 0.0201f, 0.0011f},  {0.0428f, -0.0012f, -0.0036f},
      {0.0817f, 0.0765f, 0.0749f},   {-0.1264f, -0.0522f, -0.1103f}, {-0.0280f, -0.0881f, -0.0499f},
      {-0.1262f, -0.0982f, -0.0778f}};
  const auto f = at::from_blob(const_cast<float*>(&factors[0][0]), {16, 3}, at::kFloat).to(x0.device());
  const auto rgb = at::einsum("bchw,cr->brhw", {x0.to(at::kFloat), f}) +
                   at::tensor({-0.0329, -0.0718, -0.0851}, at::TensorOptions().dtype(at::kFloat).device(x0.device()))
                       .view({1, 3, 1, 1});
  return rgb.clamp(-1, 1);
}

constexpr size_t kPromptCache = 4;  // prompts whose encodings are kept

}  // namespace

struct Flux::Impl : PipelineState {
  std::unique_ptr<text::CLIPTokenizer> tokenizer;
  models::CLIPTextModel text_encoder{nullptr};
  CLIPGraph text_graph{[this](const at::Tensor& ids) { return text_encoder->forward(ids, true); },
                       [this]() -> const models::CLIPTextConfig& { return text_encoder->text_model->config; }, false};
  std::unique_ptr<text::T5Tokenizer> tokenizer_2;
  models::T5Encoder text_encoder_2{nullptr};
  models::FluxTransformer2DModel transformer{nullptr};
  // The single-device step as CUDA graphs (packed x, context, pooled, t, guidance, rope cos, sin).
  GraphedFunction transformer_graph{[this](const std::vector<at::Tensor>& in) {
                                      const auto g = transformer->config.guidance_embeds ? in[4] : at::Tensor();
                                      return transformer->forward(in[0], in[1], in[2], in[3], g, {in[5], in[6]});
                                    },
                                    2};
  models::AutoencoderKL vae{nullptr};
  FlowMatchingScheduler scheduler;
  int max_sequence_length = 512;
  // Where T5 runs (FluxLoadOptions::t5_placement); with t5_offload it waits in host memory.
  at::Device t5_device{at::kCPU};
  at::ScalarType t5_dtype = at::kFloat;
  bool t5_offload = false;
  bool t5_apart() const { return t5_offload || t5_device != device; }
  // The last prompts' encodings (T5 [1, S, D], pooled [1, P]), newest first.
  std::list<std::tuple<std::string, job::PromptSyntax, at::Tensor, at::Tensor>> prompt_cache;
  // Multi-GPU jobs: a transformer replica on each of the group's other GPUs (whole, or one
  // PipeFusion stage's weights).
  TransformerReplicas<models::FluxTransformer2DModel> replicas{"Flux transformer", [](models::FluxTransformer2DModel& copy) {
    if (models::fused_qkv_wanted()) copy->fuse_projections();
    models::allow_fp8(*copy);
  }};

  int vae_factor() const { return static_cast<int>(vae->config.downscale_factor()); }

  // The transformer on device `d`: ours on our device and on CPU ranks (shared, read-only);
  // elsewhere a copy made on first use, of the weights `stage` (of `stages`) runs when stages > 0.
  models::FluxTransformer2DModel transformer_on(const c10::Device& d, int stage = 0, int stages = 0) {
    const int doubles = static_cast<int>(transformer->config.num_layers);
    const int singles = static_cast<int>(transformer->config.num_single_layers);
    return replicas.on(transformer, device, d, stage, stages, [=](const std::string& name) {
      return parallel::PipeFusion::uses_weight(name, stage, stages, doubles, singles);
    }, replica_ms);
  }

  // One prompt: T5's [1, max_sequence_length, D] and CLIP's pooled [1, P].
  std::pair<at::Tensor, at::Tensor> encode_one(const std::string& prompt, job::PromptSyntax syntax, job::StageTimings& t) {
    for (auto it = prompt_cache.begin(); it != prompt_cache.end(); ++it)
      if (std::get<0>(*it) == prompt && std::get<1>(*it) == syntax) {
        prompt_cache.splice(prompt_cache.begin(), prompt_cache, it);
        return {std::get<2>(*it), std::get<3>(*it)};
      }
    const auto text = syntax == job::PromptSyntax::A1111 ? text::plain_text(text::parse_prompt_attention(prompt)) : prompt;
    const auto clip = clip_prompt(*tokenizer, text, job::PromptSyntax::Plain, device, t);
    const auto t0 = Clock::now();
    const auto pooled = text_graph(clip.ids.front()).pooled.clone();
    t.text_encode_ms += ms_since(t0);
    at::Tensor t5;
    if (text_encoder_2) {
      const auto t1 = Clock::now();
      const auto tokens = tokenizer_2->encode(text, max_sequence_length);
      t.tokenize_ms += ms_since(t1);
      if (tokens.dropped > 0)
        log::get("pipeline").warn(log::str("prompt is ", tokens.dropped, " tokens over T5's ", max_sequence_length,
                                           "-token limit: the end was cut off ('", prompt.substr(0, 40), "...')"));
      const auto t2 = Clock::now();
      const auto ids = at::tensor(at::ArrayRef<int>(tokens.ids), at::kLong).unsqueeze(0).to(t5_device);
      if (t5_offload) text_encoder_2->to(t5_device);
      t5 = text_encoder_2->forward(ids).last_hidden_state.to(device, dtype);
      if (t5_offload) text_encoder_2->to(at::kCPU);
      t.text_encode_ms += ms_since(t2);
    } else {
      t5 = at::zeros({1, max_sequence_length, transformer->config.joint_attention_dim},
                     at::TensorOptions().dtype(dtype).device(device));
    }
    prompt_cache.emplace_front(prompt, syntax, t5, pooled);
    if (prompt_cache.size() > kPromptCache) prompt_cache.pop_back();
    return {t5, pooled};
  }

  at::Tensor decode_latents(const at::Tensor& latents) {
    const auto z = vae->unscale_latents(latents.to(dtype));
    const int64_t f = vae->config.downscale_factor();
    if (z.size(2) * z.size(3) * f * f > int64_t(2048) * 2048) return vae->decode_tiled(z);
    return vae->decode(z);
  }
};

namespace {

// The components must fit together; diffusers would fail deep inside a forward instead.
void check_components(const Flux::Impl& p, const fs::path& model) {
  const auto& tc = p.transformer->config;
  const auto& l = p.text_encoder->text_model->config;
  const int64_t latents = p.vae->config.latent_channels;
  if (tc.in_channels != 4 * latents || tc.out_channels != 4 * latents)
    throw Error(model.string() + ": the vae has " + std::to_string(latents) + " latent channels; the transformer takes " +
                std::to_string(tc.in_channels) + " and gives " + std::to_string(tc.out_channels) +
                " (Flux packs 2x2 patches: 4 x the latent channels)");
  if (l.hidden_size != tc.pooled_projection_dim)
    throw Error(model.string() + ": text_encoder (CLIP) gives " + std::to_string(l.hidden_size) +
                " pooled features; the transformer's pooled_projection_dim is " + std::to_string(tc.pooled_projection_dim));
  if (p.text_encoder_2 && p.text_encoder_2->options.d_model != tc.joint_attention_dim)
    throw Error(model.string() + ": text_encoder_2 (T5) gives " + std::to_string(p.text_encoder_2->options.d_model) +
                " features; the transformer's joint_attention_dim is " + std::to_string(tc.joint_attention_dim));
  if (p.tokenizer_2 && p.tokenizer_2->vocab_size() > p.text_encoder_2->options.vocab_size)
    throw Error(model.string() + ": tokenizer_2 has " + std::to_string(p.tokenizer_2->vocab_size()) +
                " tokens, more than text_encoder_2's vocab_size " + std::to_string(p.text_encoder_2->options.vocab_size));
}

void load_folder(Flux::Impl& p, const fs::path& model) {
  const auto folder = io::DiffusersFolder::open(model);
  const auto& tr_c = folder.require("transformer");
  const auto& vae_c = folder.require("vae");
  const auto& te_c = folder.require("text_encoder");
  const auto& te2_c = folder.require("text_encoder_2");
  const auto& tok_c = folder.require("tokenizer");
  const auto& tok2_c = folder.require("tokenizer_2");
  const auto& sched_c = folder.require("scheduler");
  if (tr_c.class_name != "FluxTransformer2DModel")
    throw Error(model.string() + ": transformer is a " + tr_c.class_name + ", not a FluxTransformer2DModel");
  if (vae_c.class_name != "AutoencoderKL")
    throw Error(model.string() + ": vae is a " + vae_c.class_name + "; the Flux pipeline needs an AutoencoderKL");
  if (te_c.class_name != "CLIPTextModel")
    throw Error(model.string() + ": text_encoder is a " + te_c.class_name + ", not a CLIPTextModel");
  if (te2_c.class_name != "T5EncoderModel")
    throw Error(model.string() + ": text_encoder_2 is a " + te2_c.class_name + ", not a T5EncoderModel");
  if (!text::T5Tokenizer::available())
    throw Error(model.string() + ": Flux reads the prompt with T5, whose tokenizer needs SentencePiece, and this build "
                "of Diffract has none (build with Debian's libsentencepiece-dev)");
  p.scheduler.set_file(sched_c.config);
  p.transformer = models::load_flux_transformer(tr_c.dir, tr_c.variant);
  p.vae = models::load_autoencoder_kl(vae_c.dir, vae_c.variant);
  p.text_encoder = models::load_clip_text_model(te_c.dir, te_c.variant);
  p.tokenizer = std::make_unique<text::CLIPTokenizer>(text::CLIPTokenizer::from_folder(tok_c.dir));
  check_tokenizer_fits(*p.tokenizer, p.text_encoder->text_model->config.vocab_size, tok_c.dir.string());
  p.tokenizer_2 = std::make_unique<text::T5Tokenizer>(text::T5Tokenizer::from_folder(tok2_c.dir));
  {
    std::optional<io::SuspendedPlacement> apart;
    if (p.t5_apart()) apart.emplace();  // never on the model's GPU at load
    p.text_encoder_2 = models::load_t5_encoder(te2_c.dir, te2_c.variant);
  }
  check_components(p, model);
}

void set_t5_placement(Flux::Impl& p, const std::string& placement) {
  p.t5_device = p.device;
  p.t5_dtype = p.dtype;
  p.t5_offload = false;
  if (placement.empty()) return;
  if (placement == "offload") {
    if (!p.device.is_cuda())
      throw Error("T5 placement 'offload' keeps T5 in host memory and moves it to the model's GPU to encode; this "
                  "model runs on " + p.device_name + " (use cpu, or leave the placement empty)");
    p.t5_offload = true;
    return;
  }
  try {
    p.t5_device = parse_device(placement);
  } catch (const Error& e) {
    throw Error("T5 placement '" + placement + "': " + e.what() + " (use cpu, cuda:N, offload or leave it empty)");
  }
  p.t5_dtype = p.t5_device.is_cuda() ? at::kBFloat16 : at::kFloat;
}

void load_single(Flux::Impl& p, const fs::path& file, const fs::path& config_dir) {
  if (!text::T5Tokenizer::available())
    throw Error(file.string() + ": Flux reads the prompt with T5, whose tokenizer needs SentencePiece, and this build "
                "of Diffract has none (build with Debian's libsentencepiece-dev)");
  SingleFileOptions sf;
  sf.config_dir = config_dir;
  sf.t5_on_cpu = p.t5_apart();
  auto m = load_flux_single_file(file, sf, p.dtype);
  p.transformer = m.transformer;
  p.vae = m.vae;
  p.text_encoder = m.text_encoder;
  p.text_encoder_2 = m.text_encoder_2;
  p.tokenizer = std::make_unique<text::CLIPTokenizer>(m.clip_tokenizer_dir.empty()
                                                          ? make_clip_tokenizer(m.tokenizer)
                                                          : text::CLIPTokenizer::from_folder(m.clip_tokenizer_dir));
  check_tokenizer_fits(*p.tokenizer, p.text_encoder->text_model->config.vocab_size, file.string());
  p.tokenizer_2 = std::make_unique<text::T5Tokenizer>(text::T5Tokenizer::from_folder(m.t5_tokenizer_dir));
  if (!m.scheduler_json.empty()) p.scheduler.set_file(m.scheduler_json);
  else p.scheduler.set_text(m.scheduler_text);
  check_components(p, file);
}

void move_to_device(Flux::Impl& p) {
  at::NoGradGuard no_grad;
  for (torch::nn::Module* m : {static_cast<torch::nn::Module*>(p.transformer.get()),
                               static_cast<torch::nn::Module*>(p.vae.get()),
                               static_cast<torch::nn::Module*>(p.text_encoder.get())}) {
    m->eval();
    m->to(p.device, p.dtype);
  }
  // bf16 on CUDA, never fp16: see T5EncoderImpl.
  if (p.text_encoder_2) {
    p.text_encoder_2->eval();
    p.text_encoder_2->to(p.t5_offload ? at::Device(at::kCPU) : p.t5_device, p.t5_dtype);
  }
  if (p.taesd) {
    p.taesd->eval();
    p.taesd->to(p.device, p.dtype);
  }
  if (p.device.is_cuda()) {
    if (p.taesd) models::set_memory_format(*p.taesd, at::MemoryFormat::ChannelsLast);
    at::globalContext().setBenchmarkCuDNN(true);
  }
  if (models::fused_qkv_wanted()) p.transformer->fuse_projections();
  models::allow_fp8(*p.transformer);  // a job's precision may run its linear layers in fp8
}

struct FluxJobConditioning {
  at::Tensor context, pooled;  // [negative; prompt] with CFG
  parallel::FluxConditioning positive, negative;
  at::Tensor guidance;         // [B'] float32, or undefined without the guidance embedding
};

}  // namespace

Flux::Flux(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Flux::~Flux() = default;
int Flux::native_size() const { return 1024; }
bool Flux::guidance_embedded() const { return impl_->transformer->config.guidance_embeds; }
int Flux::max_sequence_length() const { return impl_->max_sequence_length; }
std::string Flux::t5_placement() const {
  return impl_->t5_offload ? "cpu (offload)" : impl_->t5_device.str();
}

std::unique_ptr<Flux> Flux::load(const fs::path& model, const std::string& device, const LoadOptions& options) {
  const auto t0 = Clock::now();
  auto p = std::make_unique<Impl>();
  p->open(model, device);
  set_t5_placement(*p, options.t5_placement);
  {
    const auto placement = placement_for(p->device, p->dtype);
    if (fs::is_directory(model)) {
      if (!options.config_dir.empty())
        log::get("pipeline").warn("a config folder applies to single-file checkpoints; ignored for the Flux folder " +
                                  model.string());
      load_folder(*p, model);
    } else if (fs::is_regular_file(model)) {
      load_single(*p, model, options.config_dir);
    } else {
      throw Error(model.string() + ": no such Flux model folder or single file");
    }
    log_placement(placement.get(), model.string());
  }
  if (options.max_sequence_length < 0 || options.max_sequence_length > 512)
    throw Error("Flux: max_sequence_length " + std::to_string(options.max_sequence_length) + " must be 1..512 (0: the model's)");
  p->max_sequence_length =
      options.max_sequence_length > 0 ? options.max_sequence_length : p->transformer->config.guidance_embeds ? 512 : 256;
  move_to_device(*p);
  p->load_ms = ms_since(t0);
  log::get("pipeline").info(log::str("loaded ", model.string(), " (flux ", p->transformer->config.guidance_embeds ? "dev" : "schnell",
                                     ") on ", device, " in ", static_cast<int>(p->load_ms), " ms"));
  return std::unique_ptr<Flux>(new Flux(std::move(p)));
}

std::unique_ptr<Flux> Flux::random(bool tiny, bool schnell, const std::string& device) {
  const auto t0 = Clock::now();
  auto p = std::make_unique<Impl>();
  p->open(tiny ? "random-tiny-flux" : schnell ? "random-flux-schnell" : "random-flux-dev", device);
  auto tr_c = schnell ? models::FluxTransformer2DConfig::schnell() : models::FluxTransformer2DConfig::dev();
  auto vae_c = models::AutoencoderKLConfig::flux();
  auto te_c = models::CLIPTextConfig::clip_l();
  auto taesd_c = models::TAESDConfig::taef1();
  p->max_sequence_length = schnell ? 256 : 512;
  if (tiny) {  // the same architectures, a few channels wide: for CI
    tr_c.num_layers = 1, tr_c.num_single_layers = 2, tr_c.num_attention_heads = 2, tr_c.attention_head_dim = 16;
    tr_c.axes_dims_rope = {4, 6, 6};
    tr_c.joint_attention_dim = 32, tr_c.pooled_projection_dim = 32;
    te_c.hidden_size = 32, te_c.intermediate_size = 64, te_c.num_hidden_layers = 2, te_c.num_attention_heads = 2;
    vae_c.block_out_channels = {16, 16, 32, 32};
    vae_c.norm_num_groups = 8;
    taesd_c.encoder_block_out_channels = taesd_c.decoder_block_out_channels = {16, 16, 16, 16};
    p->max_sequence_length = 16;
  }
  {
    // Built on the device in its dtype: a 12 B transformer initialised on the host would take minutes.
    at::NoGradGuard no_grad;
    p->transformer = models::FluxTransformer2DModel(tr_c);
    p->vae = models::AutoencoderKL(vae_c);
    p->text_encoder = models::CLIPTextModel(te_c);
    p->taesd = models::TAESD(taesd_c, /*with_encoder=*/false);
    p->taesd_path = "<random>";
    const std::vector<torch::nn::Module*> modules = {p->transformer.get(), p->vae.get(), p->text_encoder.get(),
                                                     p->taesd.get()};
    for (auto* m : modules) models::empty_parameters_on(*m, p->device, p->dtype);
    auto gen = p->device.is_cuda() ? at::globalContext().defaultGenerator(p->device)
                                   : at::make_generator<at::CPUGeneratorImpl>(0);
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_current_seed(0);
    }
    for (auto* m : modules) models::init_random(*m, gen);
  }
  p->tokenizer = std::make_unique<text::CLIPTokenizer>(make_clip_tokenizer({}));
  p->scheduler.set_text(flux_scheduler_config(!schnell));
  move_to_device(*p);
  p->load_ms = ms_since(t0);
  return std::unique_ptr<Flux>(new Flux(std::move(p)));
}

Flux::Conditioning Flux::encode_prompt(const std::string& prompt, int batch, job::StageTimings* timings,
                                       job::PromptSyntax syntax) {
  at::NoGradGuard no_grad;
  job::StageTimings scratch;
  const auto [t5, pooled] = impl_->encode_one(prompt, syntax, timings ? *timings : scratch);
  return {t5.repeat({batch, 1, 1}), pooled.repeat({batch, 1})};
}

job::GenerationResult Flux::generate(const job::GenerationRequest& request, const job::JobObserver& observer,
                                     const job::CancelToken& cancel, const at::Tensor& initial_latents) {
  JobInputs inputs;
  inputs.initial_latents = initial_latents;
  return Pipeline::generate(request, observer, cancel, inputs);
}

PipelineState& Flux::state() { return *impl_; }
int Flux::size_multiple() const { return impl_->vae_factor() * 2; }
std::string Flux::size_multiple_why() const { return "the VAE's factor times the 2x2 patches Flux packs"; }
int Flux::latent_channels() const { return static_cast<int>(impl_->vae->config.latent_channels); }
int Flux::denoiser_in_channels() const { return static_cast<int>(impl_->transformer->config.in_channels / 4); }
int Flux::vae_factor() const { return impl_->vae_factor(); }
std::string Flux::a1111_sampler(schedulers::SamplerKind) const { return "Euler, Schedule type: Simple"; }
std::string Flux::taesd_hint() const { return "taef1"; }
std::string Flux::nan_hint() const { return "try fp32"; }

bool Flux::guided(const job::GenerationRequest& request) const {
  return request.cfg > 1.0 && !request.negative_prompt.empty();
}

void Flux::fit_schedule(schedulers::SchedulerConfig& config, int width, int height) const {
  config.linear_sigmas = true;  // FluxPipeline always passes np.linspace(1, 1 / n, n)
  if (!config.use_dynamic_shifting) return;
  const int f = impl_->vae_factor();
  config.mu = config.flow_mu(static_cast<int64_t>(height / f / 2) * (width / f / 2));
}

std::string Flux::a1111_extra(const JobContext& job) const {
  return guidance_embedded() ? ", Distilled CFG Scale: " + format_number(job.req.guidance) : std::string();
}

at::Tensor Flux::encode_image(const at::Tensor& pixels, at::Generator& generator) {
  auto& p = *impl_;
  return p.vae->scale_latents(p.vae->encode(pixels.to(p.device, p.dtype)).sample(generator));
}

std::vector<adapters::LoraComponent> Flux::lora_components() {
  auto& p = *impl_;
  return {{"transformer", p.transformer.get(), false}, {"text_encoder", p.text_encoder.get(), true}};
}

void Flux::weights_changed() {
  impl_->replicas.clear();
  impl_->prompt_cache.clear();  // a LoRA on the text encoder changes the encodings
}

schedulers::SamplerKind Flux::choose_sampler(const std::string& requested) const {
  return impl_->scheduler.choose(requested, "Flux");
}

schedulers::SchedulerConfig Flux::scheduler_config(schedulers::SamplerKind kind) const {
  return impl_->scheduler.config(kind, impl_->path.string());
}

void Flux::encode(JobContext& job) {
  auto& p = *impl_;
  const auto& req = job.req;
  if (!req.controlnets.empty()) throw Error("ControlNets run with SD 1.x / 2.x / XL models; Flux ControlNets are not supported yet");
  if (!std::isfinite(req.guidance) || req.guidance < 0 || req.guidance > 100)
    throw Error("guidance " + format_number(req.guidance) + " is outside 0..100 (Flux.1-dev's distilled guidance; 3.5 is its default)");
  const auto c = encode_prompt(req.prompt, req.batch, &job.timings, req.prompt_syntax);
  FluxJobConditioning j;
  j.positive = {c.prompt_embeds, c.pooled};
  if (job.cfg) {
    const auto n = encode_prompt(req.negative_prompt, req.batch, &job.timings, req.prompt_syntax);
    j.negative = {n.prompt_embeds, n.pooled};
    j.context = at::cat({n.prompt_embeds, c.prompt_embeds});
    j.pooled = at::cat({n.pooled, c.pooled});
  } else {
    j.context = c.prompt_embeds;
    j.pooled = c.pooled;
  }
  if (guidance_embedded())
    j.guidance = at::full({j.context.size(0)}, req.guidance, at::TensorOptions().dtype(at::kFloat).device(p.device));
  job.conditioning = std::move(j);
}

std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> Flux::denoiser(JobContext& job) {
  auto& p = *impl_;
  const auto& c = std::any_cast<const FluxJobConditioning&>(job.conditioning);
  const bool graphed = p.device.is_cuda() && options::flag(options::Id::CudaGraphs);
  const int f = p.vae_factor();
  const int64_t h = job.req.height / f, w = job.req.width / f;
  const auto opts = at::TensorOptions().device(p.device).dtype(p.dtype);
  const auto rope = p.transformer->rope(at::zeros({c.context.size(1), 3}, opts), models::latent_image_ids(h, w, opts));
  const auto guidance = c.guidance.defined() ? c.guidance : at::zeros({c.context.size(0)}, opts.dtype(at::kFloat));
  return [&p, graphed, rope, guidance, h, w, context = c.context, pooled = c.pooled](const at::Tensor& x_in,
                                                                                   const at::Tensor& t) {
    // As FluxPipeline: timestep = t in the latents' dtype, divided by 1000 in it.
    const auto x = models::pack_latents(x_in.to(p.dtype));
    const auto sigma = (t.dim() == 0 ? t.expand({x.size(0)}) : t).to(p.dtype) / 1000;
    const bool g = p.transformer->config.guidance_embeds;
    const auto v = graphed ? p.transformer_graph({x, context, pooled, sigma, guidance, rope.cos, rope.sin})
                           : p.transformer->forward(x, context, pooled, sigma, g ? guidance : at::Tensor(), rope);
    return models::unpack_latents(v, h, w);
  };
}

std::string Flux::profile_transformer_step(int size, int reps) {
  auto& p = *impl_;
  if (!p.device.is_cuda()) throw Error("profile_transformer_step needs a CUDA device");
  at::NoGradGuard no_grad;
  const auto opts = at::TensorOptions().device(p.device).dtype(p.dtype);
  const auto& c = p.transformer->config;
  const int64_t h = size / p.vae_factor(), w = h;
  const auto x = models::pack_latents(at::randn({1, c.in_channels / 4, h, w}, opts));
  const auto context = at::randn({1, p.max_sequence_length, c.joint_attention_dim}, opts);
  const auto pooled = at::randn({1, c.pooled_projection_dim}, opts);
  const auto sigma = at::full({1}, 0.5, opts);
  const auto guidance = at::full({1}, 3.5, opts.dtype(at::kFloat));
  const auto rope = p.transformer->rope(at::zeros({context.size(1), 3}, opts), models::latent_image_ids(h, w, opts));
  const auto g = c.guidance_embeds ? guidance : at::Tensor();
  return step_profile(
             size, x.size(1) + context.size(1), reps, [&] { p.transformer->forward(x, context, pooled, sigma, g, rope); },
             [&] { p.transformer_graph({x, context, pooled, sigma, guidance, rope.cos, rope.sin}); }, p.device.index())
      .dump();
}

// CPU virtual devices share our transformer (read-only in inference); GPUs get replicas, made
// here before the ranks start (PipeFusion's hold only their stage's weights).
void Flux::prepare_ranks(JobContext&, const parallel::Strategy& strategy, parallel::DeviceGroup& group) {
  for (int r = 0; r < group.size(); ++r) {
    const auto [stage, stages] = parallel::PipeFusion::rank_stage(strategy, r);
    impl_->transformer_on(group.device(r), stage, stages);
  }
}

std::unique_ptr<parallel::Denoiser> Flux::rank_denoiser(const JobContext& job, const parallel::Strategy& strategy,
                                                        int rank, const c10::Device& d) {
  auto& p = *impl_;
  const auto& c = std::any_cast<const FluxJobConditioning&>(job.conditioning);
  const auto [stage, stages] = parallel::PipeFusion::rank_stage(strategy, rank);
  return std::make_unique<parallel::FluxDenoiser>(p.transformer_on(d, stage, stages), c.positive, c.negative,
                                                  job.req.cfg, job.req.guidance, p.dtype, d);
}

double Flux::warm_timestep(const JobContext&, const schedulers::Sampler& sampler) const {
  return sampler.timesteps().front();
}

at::Tensor Flux::preview(const at::Tensor& x0, bool use_taesd, int max_side) {
  at::NoGradGuard no_grad;
  // TAEF1 decodes Flux's diffusion latents directly (see TAESDConfig).
  return use_taesd ? taesd_preview(x0, impl_->vae_factor(), max_side) : flux_latent_rgb(x0);
}

at::Tensor Flux::decode(const at::Tensor& latents, parallel::DeviceGroup*) { return impl_->decode_latents(latents); }

void Flux::add_metadata(const JobContext& job, nlohmann::json& meta) const {
  const auto& p = *impl_;
  meta["variant"] = guidance_embedded() ? "dev" : "schnell";
  if (guidance_embedded()) meta["guidance"] = job.req.guidance;
  meta["true_cfg"] = job.cfg;
  meta["t5"] = p.text_encoder_2 ? "used" : "absent";
  if (p.text_encoder_2) meta["t5_placement"] = t5_placement();
  meta["max_sequence_length"] = p.max_sequence_length;
  if (job.config.mu) meta["mu"] = *job.config.mu;
  if (!p.replicas.empty()) meta["replicas_ms"] = p.replica_ms;
}

}  // namespace diffract::pipeline
