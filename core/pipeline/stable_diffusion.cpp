#include "core/pipeline/stable_diffusion.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "core/models/common/fp8_linear.h"
#include "core/io/diffusers_folder.h"
#include "core/io/safetensors_writer.h"
#include "core/io/json_file.h"
#include "core/io/upload.h"
#include "core/models/autoencoders/autoencoder_kl.h"
#include "core/models/autoencoders/taesd.h"
#include "core/models/controlnets/controlnet.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/models/unets/unet_graphs.h"
#include "core/pipeline/clip_graph.h"
#include "core/pipeline/image_processor.h"
#include "core/pipeline/kernel_profile.h"
#include "core/pipeline/prompt_encoding.h"
#include "core/pipeline/pipeline_util.h"
#include "core/pipeline/single_file.h"
#include "core/parallel/device_group.h"
#include "core/parallel/distrifusion.h"
#include "core/parallel/parallel_vae.h"
#include "core/parallel/denoiser.h"
#include "core/parallel/strategy.h"
#include "core/schedulers/sampler.h"
#include "core/text/clip_tokenizer.h"
#include "core/util/device_work.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/options.h"

namespace diffract::pipeline {

namespace fs = std::filesystem;
using namespace detail;

namespace {

nlohmann::json capture_json(const CaptureStats& c) {
  return {{"warm_up_ms", c.warm_up_ms}, {"capture_ms", c.capture_ms}, {"warmups", c.warmups}, {"redone", c.redone}};
}

// Channel -> RGB projections of the latent spaces, for previews without a TAESD: least-squares
// fits of decoded colours to latents, as the SD community uses them.
at::Tensor latent_rgb_factors(job::ModelFamily family) {
  if (family == job::ModelFamily::SDXL)
    return at::tensor({0.3651, 0.4232, 0.4341, -0.2533, -0.0042, 0.1068, 0.1076, 0.1111, -0.0362, -0.3165, -0.2492,
                       -0.2188},
                      at::kFloat)
        .view({4, 3});
  return at::tensor({0.3512, 0.2297, 0.3227, 0.3250, 0.4974, 0.2350, -0.2829, 0.1762, 0.2721, -0.2120, -0.2616,
                     -0.7177},
                    at::kFloat)
      .view({4, 3});
}

models::UNetGraphOptions graph_options() {
  models::UNetGraphOptions o;
  o.enabled = options::flag(options::Id::CudaGraphs);
  o.stage_graphs = models::stage_graphs_from_env();  // DIFFRACT_STAGE_GRAPHS=0: the strategies' stages eager
  return o;
}

// The UNet's projections as fewer, wider GEMMs, after its weights are placed: self-attention's
// q, k, v in one GEMM each, every cross-attention's keys and values in one per step
// (attention.h), every ResNet block's time-embedding projection in one per step (resnet.h).
// DIFFRACT_FUSED_QKV=0 / DIFFRACT_FUSED_CROSS_KV=0 / DIFFRACT_FUSED_TIME_PROJ=0 leave them apart.
// Its linear layers may run in fp8 (a job's precision, fp8_linear.h).
void fuse_projections(models::UNet2DConditionModel& unet) {
  if (models::fused_qkv_wanted()) models::fuse_attention_qkv(*unet);
  if (models::fused_cross_kv_wanted()) unet->fuse_cross_attention_kv();
  if (models::fused_time_projections_wanted()) unet->fuse_time_projections();
  models::allow_fp8(*unet);
}


}  // namespace

struct StableDiffusion::Impl : PipelineState {
  job::ModelFamily family = job::ModelFamily::SD1;
  std::unique_ptr<text::CLIPTokenizer> tokenizer, tokenizer_2;
  models::CLIPTextModel text_encoder{nullptr};
  models::CLIPTextModelWithProjection text_encoder_2{nullptr};
  CLIPGraph text_graph{[this](const at::Tensor& ids) { return text_encoder->forward(ids, true); },
                       [this]() -> const models::CLIPTextConfig& { return text_encoder->text_model->config; }, false};
  CLIPGraph text_graph_2{[this](const at::Tensor& ids) { return text_encoder_2->forward(ids, true); },
                         [this]() -> const models::CLIPTextConfig& { return text_encoder_2->text_model->config; }, true};
  models::UNet2DConditionModel unet{nullptr};
  std::shared_ptr<models::UNetGraphRunner> runner;  // `unet`, replayed from CUDA graphs on a GPU
  // Multi-GPU jobs: the UNet copied to the group's other GPUs, and the group with its NCCL
  // communicators; both kept for later jobs.
  std::map<int, std::shared_ptr<models::UNetGraphRunner>> replicas;
  nlohmann::json memory_format_choice;  // what choose_memory_format() measured
  void choose_memory_format();
  models::AutoencoderKL vae{nullptr};
  // A vae/ of class AutoencoderTiny (the embedded emoji model's TAEF2) replaces `vae`.
  models::TAESD tiny_vae{nullptr};
  // The sampler settings: the folder's scheduler_config.json, or for single files the
  // scheduler SD checkpoints were trained with.
  std::function<schedulers::SchedulerConfig(schedulers::SamplerKind)> scheduler_config;
  std::optional<schedulers::SamplerKind> native_sampler;
  bool force_zeros_for_empty_prompt = false;

  int vae_factor() const {
    return static_cast<int>(tiny_vae ? tiny_vae->config.downscale_factor() : vae->config.downscale_factor());
  }

  // Diffusion latents to images in [-1, 1], with the VAE's scaling (and shift) undone. A
  // multi-device job's `group` (2 or more devices) splits the decoder over its devices in row
  // bands as parallel::parallel_vae_mode says (decode_overlapped or decode_parallel, both exact),
  // and a batch of 2 or more over its devices image by image (parallel::decode_batch_parallel)
  // unless DIFFRACT_BATCH_VAE=0; tiled decodes and the tiny VAE stay on this device.
  at::Tensor decode_latents(const at::Tensor& latents, parallel::DeviceGroup* group = nullptr) {
    if (!tiny_vae) {
      // Above 2048² pixels the decoder's activations alone run to tens of GiB: decode in tiles.
      const auto z = vae->unscale_latents(latents.to(dtype));
      const int64_t f = vae->config.downscale_factor();
      if (z.size(2) * z.size(3) * f * f > int64_t(2048) * 2048) return vae->decode_tiled(z);
      const auto replicas_on = [&] {  // made here, before the ranks start
        std::vector<models::AutoencoderKL> on;
        for (int r = 0; r < group->size(); ++r) on.push_back(vae_on(group->device(r)));
        return on;
      };
      if (group && group->size() >= 2 && z.size(0) >= 2 && parallel::batch_vae_enabled())
        return parallel::decode_batch_parallel(*group, replicas_on(), z, &last_decode_ranks);
      const auto mode = group && group->size() >= 2 ? parallel::parallel_vae_mode(z.size(2) * z.size(3) * f * f) : "";
      if (!mode.empty()) {
        const auto on = replicas_on();
        parallel::ParallelDecodeStats s;
        auto images = mode == "overlap" ? parallel::decode_overlapped(*group, on, z, &s)
                                        : parallel::decode_parallel(*group, on, z, &s);
        last_decode_ranks = s.ranks;
        return images;
      }
      last_decode_ranks = 1;
      return vae->decode(z);
    }
    const auto& c = tiny_vae->config;
    return tiny_vae->decode(latents.to(dtype) / c.scaling_factor + c.shift_factor);
  }

  // Inference mode on the job's device and dtype, for every component.
  void place() {
    at::NoGradGuard no_grad;
    for (torch::nn::Module* m : {static_cast<torch::nn::Module*>(unet.get()),
                                 vae ? static_cast<torch::nn::Module*>(vae.get()) : nullptr,
                                 tiny_vae ? static_cast<torch::nn::Module*>(tiny_vae.get()) : nullptr,
                                 static_cast<torch::nn::Module*>(text_encoder.get())}) {
      if (!m) continue;
      m->eval();
      m->to(device, dtype);
    }
    if (text_encoder_2) {
      text_encoder_2->eval();
      text_encoder_2->to(device, dtype);
    }
    if (device.is_cuda()) at::globalContext().setBenchmarkCuDNN(true);
    fuse_projections(unet);
    runner = std::make_shared<models::UNetGraphRunner>(unet, graph_options());
  }

  // The UNet on device `d`: ours, or a replica copied device to device on first use.
  std::shared_ptr<models::UNetGraphRunner> unet_on(const c10::Device& d) {
    if (d == device || d.is_cpu()) return runner;
    auto& r = replicas[d.index()];
    if (!r) {
      const auto t0 = Clock::now();
      at::NoGradGuard no_grad;
      // Built without init (uninitialised CPU tensors, no pages touched); each tensor then takes
      // a device-to-device copy of ours.
      models::UNet2DConditionModel copy(unet->config);
      copy->eval();
      copy_weights(*unet, *copy, d);
      fuse_projections(copy);
      auto o = graph_options();
      o.channels_last = runner->options().channels_last;
      r = std::make_shared<models::UNetGraphRunner>(copy, o);
      replica_ms += ms_since(t0);
      log::get("pipeline").info(log::str("UNet replica on ", d.str(), " in ", static_cast<int>(ms_since(t0)), " ms"));
    }
    return r;
  }

  // The VAE on device `d`: ours, or a replica copied device to device on first use (the
  // parallel decode's other ranks).
  std::map<int, models::AutoencoderKL> vae_replicas;
  int last_decode_ranks = 1;  // devices the last AutoencoderKL decode ran on
  models::AutoencoderKL vae_on(const c10::Device& d) {
    if (d == device || d.is_cpu()) return vae;
    if (const auto it = vae_replicas.find(d.index()); it != vae_replicas.end()) return it->second;
    const auto t0 = Clock::now();
    at::NoGradGuard no_grad;
    models::AutoencoderKL copy(vae->config);
    copy->eval();
    copy_weights(*vae, *copy, d);
    vae_replicas.emplace(d.index(), copy);
    log::get("pipeline").info(log::str("VAE replica on ", d.str(), " in ", static_cast<int>(ms_since(t0)), " ms"));
    return copy;
  }

  // ControlNets by folder, loaded on first use and kept for later jobs.
  std::map<std::string, models::ControlNetModel> controlnets;
  // The plain loop's CUDA graphs of each loaded ControlNet (DIFFRACT_CUDA_GRAPHS), by folder.
  std::map<std::string, std::shared_ptr<GraphCache>> controlnet_graphs;
  models::ControlNetModel controlnet(const std::string& path) {
    if (const auto it = controlnets.find(path); it != controlnets.end()) return it->second;
    std::error_code ec;
    auto net = std::filesystem::is_regular_file(path, ec) ? load_controlnet_file(path) : models::load_controlnet(path);
    const auto& c = net->config.unet;
    const auto& u = unet->config;
    const auto fits = c.block_out_channels == u.block_out_channels && c.layers_per_block == u.layers_per_block &&
                      c.cross_attention_dim == u.cross_attention_dim && c.addition_embed_type == u.addition_embed_type &&
                      c.in_channels == u.out_channels;
    if (!fits)
      throw Error("ControlNet " + path + " is for another model: its encoder (blocks " +
                  c10::str(at::IntArrayRef(c.block_out_channels)) + ", cross-attention " +
                  c10::str(at::IntArrayRef(c.cross_attention_dim)) + (c.addition_embed_type.empty() ? "" : ", SDXL's added embeddings") +
                  ") does not match this " + std::string(family == job::ModelFamily::SDXL ? "SDXL" : "SD") + " UNet's (blocks " +
                  c10::str(at::IntArrayRef(u.block_out_channels)) + ", cross-attention " +
                  c10::str(at::IntArrayRef(u.cross_attention_dim)) + ")");
    net->eval();
    net->to(device, dtype);
    if (device.is_cuda()) {
      // As the UNet runs: self-attention's q, k, v in one GEMM, its layout.
      if (models::fused_qkv_wanted()) models::fuse_attention_qkv(*net);
      if (runner->options().channels_last) models::set_memory_format(*net, at::MemoryFormat::ChannelsLast);
      if (options::flag(options::Id::CudaGraphs)) controlnet_graphs[path] = std::make_shared<GraphCache>(2);
    }
    controlnets.emplace(path, net);
    return net;
  }
  // A loaded ControlNet on device `d` (a strategy's rank): ours, or a replica copied device to device.
  std::map<std::pair<std::string, int>, models::ControlNetModel> controlnet_replicas;
  models::ControlNetModel controlnet_on(const std::string& path, const c10::Device& d) {
    auto net = controlnet(path);
    if (d == device || d.is_cpu()) return net;
    const auto key = std::make_pair(path, static_cast<int>(d.index()));
    if (const auto it = controlnet_replicas.find(key); it != controlnet_replicas.end()) return it->second;
    at::NoGradGuard no_grad;
    models::ControlNetModel copy(net->config);
    copy->eval();
    copy_weights(*net, *copy, d);
    controlnet_replicas.emplace(key, copy);
    return copy;
  }

  struct Conditioning {
    at::Tensor context, pooled;
  };

  // Text for one prompt (repeated `batch` times) as `syntax` reads it; `zeros` gives SDXL's empty negative.
  Conditioning encode(const std::string& prompt, job::PromptSyntax syntax, int batch, bool zeros, job::StageTimings& t) {
    at::NoGradGuard no_grad;
    Conditioning c;
    if (family == job::ModelFamily::SDXL && zeros) {
      // SDXL's empty negative prompt: zeros of the encoders' shapes, nothing to run.
      const auto opts = at::TensorOptions().device(device).dtype(dtype);
      const auto& c1 = text_encoder->text_model->config;
      const auto& c2 = text_encoder_2->text_model->config;
      c.context = at::zeros({1, tokenizer->max_length(), c1.hidden_size + c2.hidden_size}, opts);
      c.pooled = at::zeros({1, c2.projection_dim}, opts);
    } else if (family == job::ModelFamily::SDXL) {
      const auto p1 = clip_prompt(*tokenizer, prompt, syntax, device, t);
      const auto p2 = clip_prompt(*tokenizer_2, prompt, syntax, device, t);
      if (p1.ids.size() != p2.ids.size())
        throw Error("the prompt makes " + std::to_string(p1.ids.size()) + " chunks for the first text encoder and " +
                    std::to_string(p2.ids.size()) + " for the second: their tokenizers differ");
      const auto t0 = Clock::now();
      auto e1 = encode_chunks(p1, [&](const at::Tensor& ids) { return ChunkEncoding{text_graph(ids).penultimate, {}}; });
      auto e2 = encode_chunks(p2, [&](const at::Tensor& ids) {
        const auto o = text_graph_2(ids);
        return ChunkEncoding{o.penultimate, o.pooled};
      });
      c.context = at::cat({e1.hidden, e2.hidden}, -1);
      c.pooled = e2.pooled;
      t.text_encode_ms += ms_since(t0);
    } else {
      const auto p1 = clip_prompt(*tokenizer, prompt, syntax, device, t);
      const auto t0 = Clock::now();
      c.context = encode_chunks(p1, [&](const at::Tensor& ids) {
        return ChunkEncoding{text_graph(ids).last_hidden_state, {}};
      }).hidden;
      t.text_encode_ms += ms_since(t0);
    }
    c.context = c.context.repeat({batch, 1, 1});
    if (c.pooled.defined()) c.pooled = c.pooled.repeat({batch, 1});
    return c;
  }

  // Previews without a TAESD: the tiny VAE itself, from latents averaged down to max_side as a
  // TAESD's (at full size its decode cost the embedded model's 128² job ~100 ms a step on one CPU
  // thread, against ~11 ms for the UNet), else a linear latent-to-RGB projection at latent
  // resolution.
  at::Tensor latent_preview(const at::Tensor& x0, int max_side) {
    if (tiny_vae) return decode_latents(Pipeline::preview_latents(x0, vae_factor(), max_side)).clamp(-1, 1);
    auto rgb = at::einsum("bchw,cr->brhw", {x0.to(at::kFloat), latent_rgb_factors(family).to(x0.device())});
    if (family == job::ModelFamily::SDXL)
      rgb = rgb + at::tensor({0.1084, -0.0175, -0.0011}, rgb.options()).view({1, 3, 1, 1});
    return rgb.clamp(-1, 1);
  }
};

StableDiffusion::StableDiffusion(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
// DistriFusion's graphed stale steps keep per-rank buffers between jobs (up to ~10 GB a GPU at
// 2048²): a model given up gives them back. Another live pipeline's later DistriFusion jobs then
// take the eager buckets (a graph is never replayed without its buffers).
StableDiffusion::~StableDiffusion() { parallel::DistriFusion::release_static_buffers(); }
job::ModelFamily StableDiffusion::family() const { return impl_->family; }
PipelineState& StableDiffusion::state() { return *impl_; }
int StableDiffusion::native_size() const {
  return static_cast<int>(impl_->unet->config.sample_size) * impl_->vae_factor();
}

namespace {

// A diffusers AutoencoderTiny vae/ (TAESD weights; its scaling_factor / shift_factor map
// latents to the diffusion space), used for the final decode and the previews.
void load_tiny_vae(StableDiffusion::Impl& p, const io::Component& vae) {
  p.tiny_vae = models::load_taesd(vae.dir);
  if (!p.tiny_vae->has_decoder()) throw Error(vae.dir.string() + ": the AutoencoderTiny has no decoder");
  if (!(p.tiny_vae->config.scaling_factor > 0))
    throw Error(vae.config.string() + ": scaling_factor must be positive");
}

void load_folder(StableDiffusion::Impl& p, const fs::path& model) {
  const auto folder = io::DiffusersFolder::open(model);
  const auto& unet_c = folder.require("unet");
  const auto& vae_c = folder.require("vae");
  const auto& te_c = folder.require("text_encoder");
  const auto& tok_c = folder.require("tokenizer");
  const auto scheduler_json = folder.require("scheduler").config;
  p.scheduler_config = [scheduler_json](schedulers::SamplerKind k) {
    return schedulers::SchedulerConfig::from_json(scheduler_json, k);
  };
  p.native_sampler = schedulers::native_sampler(scheduler_json);
  p.unet = models::load_unet_2d_condition(unet_c.dir, unet_c.variant);
  if (vae_c.class_name == "AutoencoderTiny")
    load_tiny_vae(p, vae_c);
  else
    p.vae = models::load_autoencoder_kl(vae_c.dir, vae_c.variant);
  p.text_encoder = models::load_clip_text_model(te_c.dir, te_c.variant);
  p.tokenizer = std::make_unique<text::CLIPTokenizer>(text::CLIPTokenizer::from_folder(tok_c.dir));
  check_tokenizer_fits(*p.tokenizer, p.text_encoder->text_model->config.vocab_size, tok_c.dir.string());
  if (p.unet->config.addition_embed_type == "text_time") {
    p.family = job::ModelFamily::SDXL;
    const auto& te2 = folder.require("text_encoder_2");
    p.text_encoder_2 = models::load_clip_text_model_with_projection(te2.dir, te2.variant);
    p.tokenizer_2 = std::make_unique<text::CLIPTokenizer>(text::CLIPTokenizer::from_folder(folder.require("tokenizer_2").dir));
    check_tokenizer_fits(*p.tokenizer_2, p.text_encoder_2->text_model->config.vocab_size,
                         folder.require("tokenizer_2").dir.string());
    const auto index = io::JsonFile::read(model / "model_index.json");
    p.force_zeros_for_empty_prompt = index.optional<bool>("force_zeros_for_empty_prompt", true);
  } else {
    // SD 2.x pairs an OpenCLIP-H encoder (gelu, 1024 wide) with its UNet; SD 1.x uses CLIP-L.
    const auto& te = p.text_encoder->text_model->config;
    p.family = te.hidden_act == "gelu" || te.hidden_size == 1024 ? job::ModelFamily::SD2 : job::ModelFamily::SD1;
  }
}

// The noise schedule every SD 1.x / 2.x / XL checkpoint was trained with, for models that
// come without a scheduler_config.json.
void use_builtin_scheduler(StableDiffusion::Impl& p, const std::string& prediction_type, const std::string& what) {
  const std::string text = std::string(R"({"_class_name": "EulerDiscreteScheduler", "num_train_timesteps": 1000,
      "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1,
      "timestep_spacing": "leading", "set_alpha_to_one": false, "clip_sample": false, "prediction_type": ")") +
                           prediction_type + "\"}";
  const std::string where = what + " (built-in SD scheduler settings)";
  p.scheduler_config = [text, where](schedulers::SamplerKind k) {
    return schedulers::SchedulerConfig::from_json_text(text, k, where);
  };
  p.native_sampler = schedulers::SamplerKind::Euler;
}

void load_single(StableDiffusion::Impl& p, const fs::path& file, const fs::path& config_dir) {
  SingleFileOptions options;
  options.config_dir = config_dir;
  auto m = load_single_file(file, options);
  p.unet = m.unet;
  p.vae = m.vae;
  p.text_encoder = m.text_encoder;
  p.tokenizer = std::make_unique<text::CLIPTokenizer>(make_clip_tokenizer(m.tokenizer));
  switch (m.family) {
    case io::SingleFileFamily::SD1: p.family = job::ModelFamily::SD1; break;
    case io::SingleFileFamily::SD2: p.family = job::ModelFamily::SD2; break;
    case io::SingleFileFamily::SDXL: p.family = job::ModelFamily::SDXL; break;
  }
  if (p.family == job::ModelFamily::SDXL) {
    p.text_encoder_2 = m.text_encoder_2;
    p.tokenizer_2 = std::make_unique<text::CLIPTokenizer>(make_clip_tokenizer(*m.tokenizer_2));
    p.force_zeros_for_empty_prompt = true;
  }
  // The noise schedule every SD 1.x / 2.x / XL checkpoint was trained with; a config folder's
  // scheduler_config.json wins when given.
  if (!config_dir.empty() && fs::is_regular_file(config_dir / "scheduler" / "scheduler_config.json")) {
    const auto json = config_dir / "scheduler" / "scheduler_config.json";
    p.scheduler_config = [json](schedulers::SamplerKind k) { return schedulers::SchedulerConfig::from_json(json, k); };
    p.native_sampler = schedulers::native_sampler(json);
    return;
  }
  use_builtin_scheduler(p, m.prediction_type, file.string());
}

}  // namespace

std::unique_ptr<StableDiffusion> StableDiffusion::random(job::ModelFamily family, bool tiny, const std::string& device) {
  const auto t0 = Clock::now();
  auto p = std::make_unique<Impl>();
  p->open(std::string("random-") + (tiny ? "tiny-" : "") + std::string(job::family_name(family)), device);
  p->family = family;
  auto unet_c = family == job::ModelFamily::SDXL ? models::UNet2DConditionConfig::sdxl_base()
                : family == job::ModelFamily::SD2 ? models::UNet2DConditionConfig::sd21()
                                        : models::UNet2DConditionConfig::sd15();
  auto vae_c = family == job::ModelFamily::SDXL ? models::AutoencoderKLConfig::sdxl() : models::AutoencoderKLConfig::sd();
  auto te_c = family == job::ModelFamily::SD2 ? models::CLIPTextConfig::open_clip_h() : models::CLIPTextConfig::clip_l();
  auto te2_c = models::CLIPTextConfig::open_clip_bigg();
  auto taesd_c = family == job::ModelFamily::SDXL ? models::TAESDConfig::taesdxl() : models::TAESDConfig::taesd();
  if (tiny) {  // the same architectures, a few channels wide: for CI
    unet_c.block_out_channels = {32, 64, 64};
    unet_c.down_block_types = {"DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"};
    unet_c.up_block_types = {"CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"};
    unet_c.layers_per_block = {1, 1, 1};
    unet_c.num_attention_heads = {2, 2, 2};
    unet_c.transformer_layers_per_block = {1, 1, 1};
    unet_c.reverse_transformer_layers_per_block = {1, 1, 1};
    unet_c.norm_num_groups = 16;
    te_c.hidden_size = 32, te_c.intermediate_size = 64, te_c.num_hidden_layers = 2, te_c.num_attention_heads = 2;
    te2_c.hidden_size = 32, te2_c.intermediate_size = 64, te2_c.num_hidden_layers = 2, te2_c.num_attention_heads = 2;
    te2_c.projection_dim = 32;
    const int64_t ctx = family == job::ModelFamily::SDXL ? 64 : 32;
    unet_c.cross_attention_dim = {ctx, ctx, ctx};
    if (family == job::ModelFamily::SDXL) unet_c.projection_class_embeddings_input_dim = 32 + 6 * unet_c.addition_time_embed_dim;
    vae_c.block_out_channels = {16, 16, 32, 32};
    vae_c.norm_num_groups = 8;
    taesd_c.encoder_block_out_channels = taesd_c.decoder_block_out_channels = {16, 16, 16, 16};
  }
  p->unet = models::UNet2DConditionModel(unet_c);
  p->vae = models::AutoencoderKL(vae_c);
  p->text_encoder = models::CLIPTextModel(te_c);
  if (family == job::ModelFamily::SDXL) p->text_encoder_2 = models::CLIPTextModelWithProjection(te2_c);
  p->taesd = models::TAESD(taesd_c, /*with_encoder=*/false);
  p->taesd_path = "<random>";
  {
    // One stream seeded 0, in the order the models were built: the weights LibTorch's layers
    // gave them when their constructors drew after at::manual_seed(0).
    auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
    models::init_random(*p->unet, gen);
    models::init_random(*p->vae, gen);
    models::init_random(*p->text_encoder, gen);
    if (p->text_encoder_2) models::init_random(*p->text_encoder_2, gen);
    models::init_random(*p->taesd, gen);
  }
  {
    // Halved, as the diffusers anchor does: default init compounds to overflow over 70 blocks.
    at::NoGradGuard no_grad;
    for (auto& w : p->unet->parameters()) w.mul_(0.5);
  }
  p->tokenizer = std::make_unique<text::CLIPTokenizer>(make_clip_tokenizer({}));
  if (family == job::ModelFamily::SDXL) {
    text::CLIPTokenizerOptions bang;
    bang.pad_token = "!";
    p->tokenizer_2 = std::make_unique<text::CLIPTokenizer>(make_clip_tokenizer(bang));
    p->force_zeros_for_empty_prompt = true;
  }
  use_builtin_scheduler(*p, family == job::ModelFamily::SD2 ? "v_prediction" : "epsilon", p->path.string());
  p->taesd->eval();
  p->taesd->to(p->device, p->dtype);
  if (p->device.is_cuda()) models::set_memory_format(*p->taesd, at::MemoryFormat::ChannelsLast);
  p->place();
  p->load_ms = ms_since(t0);
  return std::unique_ptr<StableDiffusion>(new StableDiffusion(std::move(p)));
}

std::unique_ptr<StableDiffusion> StableDiffusion::load(const fs::path& model, const std::string& device,
                                                       const fs::path& config_dir) {
  const auto t0 = Clock::now();
  auto p = std::make_unique<Impl>();
  p->open(model, device);

  {
    const auto placement = placement_for(p->device, p->dtype);
    if (fs::is_regular_file(model)) {
      load_single(*p, model, config_dir);
    } else {
      load_folder(*p, model);
    }
    log_placement(placement.get(), model.string());
  }
  p->place();
  p->load_ms = ms_since(t0);
  log::get("pipeline").info(log::str("loaded ", model.string(), " (", job::family_name(p->family), ") on ", device, " in ",
                                     static_cast<int>(p->load_ms), " ms"));
  return std::unique_ptr<StableDiffusion>(new StableDiffusion(std::move(p)));
}

namespace {

models::UNetConditioning to_device(const models::UNetConditioning& c, const c10::Device& d) {
  models::UNetConditioning o;
  if (c.encoder_hidden_states.defined()) o.encoder_hidden_states = c.encoder_hidden_states.to(d);
  if (c.text_embeds.defined()) o.text_embeds = c.text_embeds.to(d);
  if (c.time_ids.defined()) o.time_ids = c.time_ids.to(d);
  return o;
}

// One job's UNet conditioning: each branch alone (the strategies' ranks) and both as one batch,
// [negative; prompt] (the plain loop).
// A ControlNet as a job runs it: the control image at the job's size, for every row of the batch
// the plain loop's denoiser sees (both CFG halves).
struct SDControl {
  models::ControlNetUnit unit;  // its scale, start and end are the request's
  std::string path;
};

struct SDConditioning {
  models::UNetConditioning positive, negative, batched;
  const char* negative_source = "none";  // "encoded", "zeros" (SDXL's force_zeros_for_empty_prompt) or "none" (no CFG)
  std::vector<SDControl> controls;
};

}  // namespace

std::string StableDiffusion::profile_unet_step(int size, int rows, int reps) {
  auto& p = *impl_;
  if (!p.device.is_cuda()) throw Error("profile_unet_step needs a CUDA device");
  at::NoGradGuard no_grad;
  const auto opts = at::TensorOptions().device(p.device).dtype(p.dtype);
  const auto& c = p.unet->config;
  const int64_t lat = size / p.vae_factor();
  auto x = at::randn({rows, c.in_channels, lat, lat}, opts);
  auto t = at::full({rows}, 500.0, at::TensorOptions().device(p.device).dtype(at::kFloat));
  models::UNetConditioning cond;
  cond.encoder_hidden_states = at::randn({rows, 77, c.cross_attention_dim.front()}, opts);
  if (c.addition_embed_type == "text_time") {
    cond.text_embeds = at::randn({rows, c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim}, opts);
    cond.time_ids = at::tensor({double(size), double(size), 0.0, 0.0, double(size), double(size)}, at::kFloat)
                        .view({1, 6}).repeat({rows, 1}).to(opts);
  }
  auto time_ms = [&](const std::function<void()>& f) { return mean_cuda_ms(reps, f, p.device.index(), 2); };
  nlohmann::json j;
  j["rows"] = rows;
  j["size"] = size;
  // Every variant through the pipeline's own runner, which is put back as it was at the end.
  const bool was_channels_last = p.runner->options().channels_last;
  const auto variant = [&](bool channels_last, bool fused_group_norm, const char* name) {
    p.runner->set_channels_last(channels_last);
    models::set_fused_group_norm(fused_group_norm);
    p.runner->clear();
    p.runner->forward(x, t, cond);
    j[std::string(name) + "_capture_ms"] = p.runner->last_capture().total_ms;
    j[std::string(name) + "_ms"] = time_ms([&] { p.runner->forward(x, t, cond); });
  };
  p.runner->set_channels_last(false);
  j["eager_ms"] = time_ms([&] { p.unet->forward(x, t, cond); });
  j["kernels"] = kernel_profile(reps, [&] { p.unet->forward(x, t, cond); }, p.device.index());
  variant(false, true, "graph");
  j["capture_ms"] = j["graph_capture_ms"];
  variant(true, true, "graph_channels_last");
  if (models::fused_group_norm_available()) {
    variant(false, false, "graph_aten_group_norm");
    variant(true, false, "graph_channels_last_aten_group_norm");
  }
  models::set_fused_group_norm(true);
  p.runner->set_channels_last(true);
  const auto xl = x.contiguous(at::MemoryFormat::ChannelsLast);
  j["kernels_channels_last"] = kernel_profile(reps, [&] { p.unet->forward(xl, t, cond); }, p.device.index());
  p.runner->set_channels_last(was_channels_last);
  // The graphs just captured ran the variants' settings (the last one ATen's GroupNorm): later
  // jobs must capture their own, or they replay the slowest variant.
  p.runner->clear();
  j["fused_group_norm"] = models::fused_group_norm_available();
  return j.dump();
}

// channels-last or not for this UNet on this GPU, by measurement: the graph of one CFG step at
// the native size, a few replays each way (which layout wins differs between models and
// GroupNorm kernels). DIFFRACT_CHANNELS_LAST=0/1 decides instead.
void StableDiffusion::Impl::choose_memory_format() {
  if (!device.is_cuda() || !runner->options().enabled) return;
  if (const auto forced = options::value(options::Id::ChannelsLast); !forced.empty()) {
    runner->set_channels_last(forced == "1");
    memory_format_choice = {{"forced", forced == "1" ? "channels_last" : "nchw"}};
    return;
  }
  at::NoGradGuard no_grad;
  const int64_t size = unet->config.sample_size * vae_factor();
  const auto opts = at::TensorOptions().device(device).dtype(dtype);
  const auto& c = unet->config;
  const int64_t lat = size / vae_factor();
  auto x = at::randn({2, c.in_channels, lat, lat}, opts);
  auto t = at::full({2}, 500.0, at::TensorOptions().device(device).dtype(at::kFloat));
  models::UNetConditioning cond;
  cond.encoder_hidden_states = at::randn({2, 77, c.cross_attention_dim.front()}, opts);
  if (c.addition_embed_type == "text_time") {
    cond.text_embeds = at::randn({2, c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim}, opts);
    const double s = static_cast<double>(size);
    cond.time_ids = at::tensor({s, s, 0.0, 0.0, s, s}, at::kFloat).view({1, 6}).repeat({2, 1}).to(opts);
  }
  const auto measure = [&](bool channels_last) {
    runner->set_channels_last(channels_last);
    runner->forward(x, t, cond);  // capture
    torch::cuda::synchronize(device.index());
    const auto t0 = Clock::now();
    for (int i = 0; i < 5; ++i) runner->forward(x, t, cond);
    torch::cuda::synchronize(device.index());
    return ms_since(t0) / 5;
  };
  const double nchw = measure(false), nhwc = measure(true);
  if (nchw <= nhwc) runner->set_channels_last(false);
  memory_format_choice = {{"nchw_ms", nchw}, {"channels_last_ms", nhwc}, {"size", size}};
  log::get("pipeline").info(log::str("UNet step at ", size, "²: NCHW ", nchw, " ms, channels-last ", nhwc,
                                     " ms; running ", nchw <= nhwc ? "NCHW" : "channels-last"));
}

void StableDiffusion::before_warm_up() { impl_->choose_memory_format(); }

job::GenerationResult StableDiffusion::generate(const job::GenerationRequest& request, const job::JobObserver& observer,
                                                const job::CancelToken& cancel, const parallel::Strategy* strategy) {
  JobInputs inputs;
  inputs.strategy = strategy;
  return Pipeline::generate(request, observer, cancel, inputs);
}

int StableDiffusion::size_multiple() const { return impl_->vae_factor(); }
std::string StableDiffusion::size_multiple_why() const { return "the model's latent factor"; }
int StableDiffusion::latent_channels() const { return static_cast<int>(impl_->unet->config.out_channels); }
int StableDiffusion::denoiser_in_channels() const { return static_cast<int>(impl_->unet->config.in_channels); }

at::Tensor StableDiffusion::encode_image(const at::Tensor& pixels, at::Generator& generator) {
  auto& p = *impl_;
  if (p.tiny_vae) {
    if (!p.tiny_vae->has_encoder())
      throw Error(p.path.string() + ": the model's AutoencoderTiny has no encoder, so it cannot take an init image");
    const auto& c = p.tiny_vae->config;
    return (p.tiny_vae->encode(pixels.to(p.device, p.dtype)) - c.shift_factor) * c.scaling_factor;
  }
  return p.vae->scale_latents(p.vae->encode(pixels.to(p.device, p.dtype)).sample(generator));
}
int StableDiffusion::vae_factor() const { return impl_->vae_factor(); }
std::string StableDiffusion::taesd_hint() const { return impl_->family == job::ModelFamily::SDXL ? "taesdxl" : "taesd"; }
std::string StableDiffusion::nan_hint() const { return "try another sampler or fp32"; }

void StableDiffusion::write_random_controlnet(const std::filesystem::path& dir, std::uint64_t seed) const {
  const auto& u = impl_->unet->config;
  nlohmann::json j = {{"_class_name", "ControlNetModel"},
                      {"in_channels", u.out_channels},
                      {"down_block_types", u.down_block_types},
                      {"block_out_channels", u.block_out_channels},
                      {"layers_per_block", u.layers_per_block},
                      {"cross_attention_dim", u.cross_attention_dim},
                      {"transformer_layers_per_block", u.transformer_layers_per_block},
                      {"num_attention_heads", u.num_attention_heads},
                      {"use_linear_projection", u.use_linear_projection},
                      {"norm_num_groups", u.norm_num_groups},
                      {"norm_eps", u.norm_eps},
                      {"flip_sin_to_cos", u.flip_sin_to_cos},
                      {"freq_shift", u.freq_shift}};
  if (!u.addition_embed_type.empty()) {
    j["addition_embed_type"] = u.addition_embed_type;
    j["addition_time_embed_dim"] = u.addition_time_embed_dim;
    j["projection_class_embeddings_input_dim"] = u.projection_class_embeddings_input_dim;
  }
  // One stride-2 stage of the conditioning embedding per halving of the VAE.
  std::vector<int64_t> embedding = {16};
  for (int f = impl_->vae_factor(); f > 1; f /= 2) embedding.push_back(embedding.back() * 2);
  j["conditioning_embedding_out_channels"] = embedding;
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << j.dump(1);
  models::ControlNetModel net(models::ControlNetConfig::from_json(dir / "config.json"));
  models::init_random(*net, at::detail::createCPUGenerator(seed));
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& p : net->named_parameters()) tensors.emplace_back(p.key(), p.value().to(at::kHalf));
  io::write_safetensors(dir / "diffusion_pytorch_model.safetensors", tensors);
}

std::vector<adapters::LoraComponent> StableDiffusion::lora_components() {
  auto& p = *impl_;
  std::vector<adapters::LoraComponent> c{{"unet", p.unet.get(), false}, {"text_encoder", p.text_encoder.get(), true}};
  if (p.text_encoder_2) c.push_back({"text_encoder_2", p.text_encoder_2.get(), true});
  return c;
}

void StableDiffusion::weights_changed() { impl_->replicas.clear(); }

schedulers::SamplerKind StableDiffusion::choose_sampler(const std::string& requested) const {
  const auto& p = *impl_;
  schedulers::SamplerKind kind;
  if (requested.empty()) {
    kind = p.native_sampler.value_or(schedulers::SamplerKind::Euler);
    if (!p.native_sampler)
      log::get("pipeline").info("the model's own scheduler is not supported here; using euler (choose with --scheduler)");
  } else {
    kind = schedulers::parse_sampler_or_throw(requested);
  }
  if (schedulers::is_flow_matching(kind))
    throw Error("the " + std::string(schedulers::sampler_name(kind)) +
                " sampler is for flow-matching models (SD3); SD 1.x / 2.x / XL predict noise or v");
  return kind;
}

schedulers::SchedulerConfig StableDiffusion::scheduler_config(schedulers::SamplerKind kind) const {
  return impl_->scheduler_config(kind);
}

std::string StableDiffusion::a1111_sampler(schedulers::SamplerKind k) const {
  using K = schedulers::SamplerKind;
  switch (k) {
    case K::Euler: return "Euler";
    case K::EulerAncestral: return "Euler a";
    case K::DDIM: return "DDIM";
    case K::DDPM: return "DDPM";
    case K::DPMPP2M: return "DPM++ 2M";
    case K::DPMPP2MKarras: return "DPM++ 2M Karras";
    case K::FlowMatchEuler: return "Euler";  // what A1111 / Forge call SD3's flow sampler
  }
  return "";
}

void StableDiffusion::encode(JobContext& job) {
  auto& p = *impl_;
  const auto& req = job.req;
  const auto branch = [&](const Impl::Conditioning& c) {
    models::UNetConditioning u;
    u.encoder_hidden_states = c.context;
    if (p.family == job::ModelFamily::SDXL) {
      const auto h = static_cast<double>(req.height), w = static_cast<double>(req.width);
      u.time_ids = at::tensor({h, w, 0.0, 0.0, h, w}, at::kFloat).view({1, 6}).repeat({req.batch, 1}).to(p.device, p.dtype);
      u.text_embeds = c.pooled;
    }
    return u;
  };
  SDConditioning c;
  c.positive = branch(p.encode(req.prompt, req.prompt_syntax, req.batch, false, job.timings));
  c.batched = c.positive;
  if (job.cfg) {
    // diffusers' SDXL pipelines use zeros for a negative prompt not given when the model's
    // force_zeros_for_empty_prompt is true (SDXL base ships it so); an empty one here is "not given".
    const bool zeros = p.family == job::ModelFamily::SDXL && req.negative_prompt.empty() && p.force_zeros_for_empty_prompt;
    c.negative_source = zeros ? "zeros" : "encoded";
    c.negative = branch(p.encode(req.negative_prompt, req.prompt_syntax, req.batch, zeros, job.timings));
    // Prompts of different chunk counts: both repeated to a common length, which cross-attention
    // cannot tell from running them apart (prompt_encoding.h).
    auto& pos = c.positive.encoder_hidden_states;
    auto& neg = c.negative.encoder_hidden_states;
    if (pos.size(1) != neg.size(1)) {
      const auto tokens = common_length(pos.size(1), neg.size(1));
      pos = repeat_tokens(pos, tokens);
      neg = repeat_tokens(neg, tokens);
    }
    c.batched.encoder_hidden_states = at::cat({c.negative.encoder_hidden_states, c.positive.encoder_hidden_states});
    if (p.family == job::ModelFamily::SDXL) {
      c.batched.time_ids = at::cat({c.negative.time_ids, c.positive.time_ids});
      c.batched.text_embeds = at::cat({c.negative.text_embeds, c.positive.text_embeds});
    }
  }
  for (const auto& ref : req.controlnets) {
    SDControl control;
    control.path = ref.path;
    control.unit.net = p.controlnet(ref.path);
    control.unit.scale = ref.scale;
    control.unit.start = ref.start;
    control.unit.end = ref.end;
    // diffusers' control image: resized (Lanczos) to the job's size, in [0, 1], one per image, both CFG halves.
    const auto image = ref.image.width == req.width && ref.image.height == req.height
                           ? ref.image : resize_lanczos(ref.image, req.width, req.height);
    const auto x = (image_tensor(image) + 1.0) / 2.0;
    control.unit.image = x.repeat({req.batch * (job.cfg ? 2 : 1), 1, 1, 1}).to(p.device, p.dtype);
    if (const auto it = p.controlnet_graphs.find(ref.path); it != p.controlnet_graphs.end()) {
      control.unit.graphs = it->second;
      if (p.runner->options().channels_last) control.unit.layout = at::MemoryFormat::ChannelsLast;
    }
    c.controls.push_back(std::move(control));
  }
  job.conditioning = std::move(c);
}

std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> StableDiffusion::denoiser(JobContext& job) {
  auto& p = *impl_;
  const auto& conditioning = std::any_cast<const SDConditioning&>(job.conditioning);
  const auto cond = conditioning.batched;
  if (conditioning.controls.empty())
    return [&p, cond](const at::Tensor& x_in, const at::Tensor& t) { return p.runner->forward(x_in.to(p.dtype), t, cond); };
  // With ControlNets: each one's residuals on the steps inside its [start, end], summed, added to
  // the UNet's. Every sampler here evaluates the denoiser once a step, so the calls count the steps.
  std::vector<models::ControlNetUnit> units;
  for (const auto& c : conditioning.controls) units.push_back(c.unit);
  auto step = std::make_shared<int>(0);
  const auto n = static_cast<int>(job.run_timesteps.size());
  return [&p, cond, units, step, n](const at::Tensor& x_in, const at::Tensor& t) {
    const auto x = x_in.to(p.dtype);
    return p.runner->forward(x, t, models::add_controlnet_residuals(cond, units, x, t, (*step)++, n));
  };
}

// CPU virtual devices share the one loaded UNet (read-only in inference); GPUs get replicas
// copied from ours, made here before the ranks start.
void StableDiffusion::prepare_ranks(JobContext& job, const parallel::Strategy&, parallel::DeviceGroup& group) {
  const auto& c = std::any_cast<const SDConditioning&>(job.conditioning);
  for (int r = 0; r < group.size(); ++r) {
    impl_->unet_on(group.device(r));
    for (const auto& control : c.controls) impl_->controlnet_on(control.path, group.device(r));
  }
}

std::unique_ptr<parallel::Denoiser> StableDiffusion::rank_denoiser(const JobContext& job, const parallel::Strategy&,
                                                                   int, const c10::Device& d) {
  auto& p = *impl_;
  const auto& c = std::any_cast<const SDConditioning&>(job.conditioning);
  auto denoiser = std::make_unique<parallel::UNetDenoiser>(p.unet_on(d), to_device(c.positive, d),
                                                           job.cfg ? to_device(c.negative, d) : models::UNetConditioning{},
                                                           job.req.cfg, p.dtype, d);
  if (!c.controls.empty()) {
    // One branch's rows of each control image (the plain loop's hold both CFG halves).
    std::vector<models::ControlNetUnit> units;
    for (const auto& control : c.controls) {
      auto u = control.unit.rows(0, job.req.batch);
      u.net = p.controlnet_on(control.path, d);
      u.graphs.reset();  // the plain loop's, not to be shared between rank threads
      u.layout.reset();
      u.image = u.image.to(d);
      units.push_back(std::move(u));
    }
    denoiser->set_controlnets(std::move(units), job.run_timesteps);
  }
  return denoiser;
}

double StableDiffusion::warm_timestep(const JobContext& job, const schedulers::Sampler&) const {
  return job.config.num_train_timesteps - 1.0;
}

at::Tensor StableDiffusion::preview(const at::Tensor& x0, bool use_taesd, int max_side) {
  at::NoGradGuard no_grad;
  return use_taesd ? taesd_preview(x0, impl_->vae_factor(), max_side) : impl_->latent_preview(x0, max_side);
}

at::Tensor StableDiffusion::decode(const at::Tensor& latents, parallel::DeviceGroup* group) {
  impl_->last_decode_ranks = 1;
  return impl_->decode_latents(latents, group);
}

void StableDiffusion::add_metadata(const JobContext& job, nlohmann::json& meta) const {
  const auto& p = *impl_;
  const auto& conditioning = std::any_cast<const SDConditioning&>(job.conditioning);
  meta["negative_conditioning"] = conditioning.negative_source;
  for (const auto& c : conditioning.controls)
    meta["controlnets"].push_back({{"path", c.path}, {"scale", c.unit.scale}, {"start", c.unit.start}, {"end", c.unit.end}});
  if (meta.contains("strategy") && !p.tiny_vae) meta["vae_decode_devices"] = p.last_decode_ranks;
  if (p.device.is_cuda())
    meta["unet_graphs"] = {{"graphs", p.runner->graphs()},
                           {"last_capture_ms", p.runner->last_capture().total_ms},
                           {"last_capture", capture_json(p.runner->last_capture())},
                           {"stage_graphs", p.runner->stage_graphs()},
                           {"replicas_ms", p.replica_ms},
                           {"channels_last", p.runner->options().channels_last},
                           {"memory_format_choice", p.memory_format_choice}};
}

}  // namespace diffract::pipeline
