#include "core/pipeline/stable_diffusion_3.h"

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "core/io/diffusers_folder.h"
#include "core/io/json_file.h"
#include "core/io/upload.h"
#include "core/models/common/fp8_linear.h"
#include "core/models/autoencoders/autoencoder_kl.h"
#include "core/models/autoencoders/taesd.h"
#include "core/util/graphed_function.h"
#include "core/models/common/layers.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/models/text_encoders/t5_encoder.h"
#include "core/models/transformers/sd3_transformer_2d.h"
#include "core/parallel/pipefusion.h"
#include "core/parallel/denoiser.h"
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
#include "core/util/log.h"
#include "core/util/options.h"

namespace diffract::pipeline {

namespace fs = std::filesystem;
using namespace detail;

namespace {
bool graphs_enabled() {
  return options::flag(options::Id::CudaGraphs);
}
}  // namespace

namespace {

// SD3's 16 latent channels -> RGB, for previews without a TAESD: the least-squares factors
// ComfyUI's SD3 latent format uses (an approximation at latent resolution, nothing more).
at::Tensor sd3_latent_rgb(const at::Tensor& x0) {
  static const float factors[16][3] = {
      {-0.0922f, -0.0175f, 0.0749f}, {0.0311f, 0.0633f, 0.0954f},  {0.1994f, 0.0927f, 0.0458f},
      {0.0856f, 0.0339f, 0.0902f},   {0.0587f, 0.0272f, -0.0496f}, {-0.0006f, 0.1104f, 0.0309f},
      {0.0978f, 0.0306f, 0.0427f},   {-0.0042f, 0.1038f, 0.1358f}, {-0.0194f, 0.0020f, 0.0669f},
      {-0.0488f, 0.0130f, -0.0268f}, {0.0922f, 0.0988f, 0.0951f},  {-0.0278f, 0.0524f, -0.0542f},
      {0.0332f, 0.0456f, 0.0895f},   {-0.0069f, -0.0030f, -0.0810f}, {-0.0596f, -0.0465f, -0.0293f},
      {-0.1448f, -0.1463f, -0.1189f}};
  const auto f = at::from_blob(const_cast<float*>(&factors[0][0]), {16, 3}, at::kFloat).to(x0.device());
  auto rgb = at::einsum("bchw,cr->brhw", {x0.to(at::kFloat), f});
  rgb = rgb + at::tensor({0.2394, 0.2135, 0.1925}, rgb.options()).view({1, 3, 1, 1});
  return (rgb * 2 - 1).clamp(-1, 1);  // the factors give [0, 1] colours
}

}  // namespace

struct StableDiffusion3::Impl : PipelineState {
  std::unique_ptr<text::CLIPTokenizer> tokenizer, tokenizer_2;
  models::CLIPTextModelWithProjection text_encoder{nullptr}, text_encoder_2{nullptr};
  CLIPGraph text_graph{[this](const at::Tensor& ids) { return text_encoder->forward(ids, true); },
                       [this]() -> const models::CLIPTextConfig& { return text_encoder->text_model->config; }, true};
  CLIPGraph text_graph_2{[this](const at::Tensor& ids) { return text_encoder_2->forward(ids, true); },
                         [this]() -> const models::CLIPTextConfig& { return text_encoder_2->text_model->config; }, true};
  std::unique_ptr<text::T5Tokenizer> tokenizer_3;
  models::T5Encoder text_encoder_3{nullptr};
  models::SD3Transformer2DModel transformer{nullptr};
  // The single-device step as CUDA graphs (x, context, pooled, t); DIFFRACT_CUDA_GRAPHS=0: eager.
  GraphedFunction transformer_graph{
      [this](const std::vector<at::Tensor>& in) { return transformer->forward(in[0], in[1], in[2], in[3]); }, 2};
  models::AutoencoderKL vae{nullptr};
  FlowMatchingScheduler scheduler;
  bool t5_dropped = false;
  int max_sequence_length = 256;
  // Multi-GPU jobs: a transformer replica on each of the group's other GPUs (whole, or one
  // PipeFusion stage's weights), by device and what it holds; the groups with their NCCL
  // communicators.
  TransformerReplicas<models::SD3Transformer2DModel> replicas{"SD3 transformer", [](models::SD3Transformer2DModel& copy) {
    if (models::fused_qkv_wanted()) copy->fuse_projections();
    models::allow_fp8(*copy);
  }};

  int vae_factor() const { return static_cast<int>(vae->config.downscale_factor()); }

  // The transformer on device `d`: ours on our device and on CPU ranks (shared, read-only);
  // elsewhere a copy made on first use, of the weights `stage` (of `stages`) runs when stages > 0.
  models::SD3Transformer2DModel transformer_on(const c10::Device& d, int stage = 0, int stages = 0) {
    const int layers = static_cast<int>(transformer->config.num_layers);
    return replicas.on(transformer, device, d, stage, stages, [=](const std::string& name) {
      return parallel::PipeFusion::uses_weight(name, stage, stages, layers);
    }, replica_ms);
  }

  // Pixel sizes must be multiples of this: the VAE's factor times the transformer's patch.
  int size_multiple() const { return vae_factor() * static_cast<int>(transformer->config.patch_size); }

  // One prompt: CLIP's part [1, 77 * chunks, joint], T5's [1, max_sequence_length, joint], pooled [1, P].
  struct Encoded {
    at::Tensor clip, t5, pooled;
  };
  Encoded encode_one(const std::string& prompt, job::PromptSyntax syntax, job::StageTimings& t, bool use_t5) {
    const auto p1 = clip_prompt(*tokenizer, prompt, syntax, device, t);
    const auto p2 = clip_prompt(*tokenizer_2, prompt, syntax, device, t);
    if (p1.ids.size() != p2.ids.size())
      throw Error("the prompt makes " + std::to_string(p1.ids.size()) + " chunks for CLIP-L and " +
                  std::to_string(p2.ids.size()) + " for CLIP-G: their tokenizers differ");
    const auto t0 = Clock::now();
    const auto e1 = encode_chunks(p1, [&](const at::Tensor& ids) {
      const auto o = text_graph(ids);
      return ChunkEncoding{o.penultimate, o.pooled};
    });
    const auto e2 = encode_chunks(p2, [&](const at::Tensor& ids) {
      const auto o = text_graph_2(ids);
      return ChunkEncoding{o.penultimate, o.pooled};
    });
    Encoded e;
    e.clip = at::cat({e1.hidden, e2.hidden}, -1);
    const int64_t joint = transformer->config.joint_attention_dim;
    e.clip = at::constant_pad_nd(e.clip, {0, joint - e.clip.size(-1)});  // checked at load: never negative
    e.pooled = at::cat({e1.pooled, e2.pooled}, -1);
    t.text_encode_ms += ms_since(t0);
    if (use_t5) {
      const auto t1 = Clock::now();
      const auto text = syntax == job::PromptSyntax::A1111 ? text::plain_text(text::parse_prompt_attention(prompt)) : prompt;
      const auto tokens = tokenizer_3->encode(text, max_sequence_length);
      t.tokenize_ms += ms_since(t1);
      if (tokens.dropped > 0)
        log::get("pipeline").warn(log::str("prompt is ", tokens.dropped, " tokens over T5's ", max_sequence_length,
                                           "-token limit: the end was cut off ('", prompt.substr(0, 40), "...')"));
      const auto t2 = Clock::now();
      const auto ids = at::tensor(at::ArrayRef<int>(tokens.ids), at::kLong).unsqueeze(0).to(device);
      e.t5 = text_encoder_3->forward(ids).last_hidden_state.to(e.clip.scalar_type());  // d_model == joint, checked at load
      t.text_encode_ms += ms_since(t2);
    } else {
      e.t5 = at::zeros({1, max_sequence_length, joint}, e.clip.options());
    }
    return e;
  }

  at::Tensor decode_latents(const at::Tensor& latents) {
    const auto z = vae->unscale_latents(latents.to(dtype));
    const int64_t f = vae->config.downscale_factor();
    if (z.size(2) * z.size(3) * f * f > int64_t(2048) * 2048) return vae->decode_tiled(z);
    return vae->decode(z);
  }
};

namespace {

void check_components(const StableDiffusion3::Impl& p, const fs::path& model);

void load_folder(StableDiffusion3::Impl& p, const fs::path& model, const StableDiffusion3::LoadOptions& options) {
  const auto folder = io::DiffusersFolder::open(model);
  const auto& tr_c = folder.require("transformer");
  const auto& vae_c = folder.require("vae");
  const auto& te_c = folder.require("text_encoder");
  const auto& te2_c = folder.require("text_encoder_2");
  const auto& tok_c = folder.require("tokenizer");
  const auto& tok2_c = folder.require("tokenizer_2");
  const auto& sched_c = folder.require("scheduler");
  if (tr_c.class_name != "SD3Transformer2DModel")
    throw Error(model.string() + ": transformer is a " + tr_c.class_name + ", not an SD3Transformer2DModel");
  if (vae_c.class_name != "AutoencoderKL")
    throw Error(model.string() + ": vae is a " + vae_c.class_name + "; the SD3 pipeline needs an AutoencoderKL");
  const bool t5_listed = folder.find("text_encoder_3") || folder.find("tokenizer_3");
  if (t5_listed && options.drop_t5) {
    p.t5_dropped = true;
    log::get("pipeline").info(model.string() + ": T5 (text_encoder_3) dropped as asked; its part of the prompt "
                              "embedding is zeros");
  } else if (t5_listed && !text::T5Tokenizer::available()) {
    p.t5_dropped = true;
    log::get("pipeline").warn(
        model.string() + " has a T5 text encoder (text_encoder_3), but this build of Diffract has no SentencePiece "
        "(Debian libsentencepiece-dev) for its tokenizer: it runs without T5, T5's part of the prompt embedding "
        "zeros (as diffusers with text_encoder_3=None); prompts are followed less closely than with T5");
  } else if (t5_listed) {
    const auto& te3_c = folder.require("text_encoder_3");
    const auto& tok3_c = folder.require("tokenizer_3");
    if (te3_c.class_name != "T5EncoderModel")
      throw Error(model.string() + ": text_encoder_3 is a " + te3_c.class_name + ", not a T5EncoderModel");
    p.tokenizer_3 = std::make_unique<text::T5Tokenizer>(text::T5Tokenizer::from_folder(tok3_c.dir));
    p.text_encoder_3 = models::load_t5_encoder(te3_c.dir, te3_c.variant);
  }
  p.scheduler.set_file(sched_c.config);
  p.transformer = models::load_sd3_transformer(tr_c.dir, tr_c.variant);
  p.vae = models::load_autoencoder_kl(vae_c.dir, vae_c.variant);
  p.text_encoder = models::load_clip_text_model_with_projection(te_c.dir, te_c.variant);
  p.text_encoder_2 = models::load_clip_text_model_with_projection(te2_c.dir, te2_c.variant);
  p.tokenizer = std::make_unique<text::CLIPTokenizer>(text::CLIPTokenizer::from_folder(tok_c.dir));
  p.tokenizer_2 = std::make_unique<text::CLIPTokenizer>(text::CLIPTokenizer::from_folder(tok2_c.dir));
  check_tokenizer_fits(*p.tokenizer, p.text_encoder->text_model->config.vocab_size, tok_c.dir.string());
  check_tokenizer_fits(*p.tokenizer_2, p.text_encoder_2->text_model->config.vocab_size, tok2_c.dir.string());
  check_components(p, model);
}

// The components must fit together; diffusers would fail deep inside a forward instead.
void check_components(const StableDiffusion3::Impl& p, const fs::path& model) {
  const auto& tc = p.transformer->config;
  const auto& l = p.text_encoder->text_model->config;
  const auto& g = p.text_encoder_2->text_model->config;
  if (p.vae->config.latent_channels != tc.out_channels ||
      (tc.in_channels != tc.out_channels && tc.in_channels != 2 * tc.out_channels + 1))
    throw Error(model.string() + ": the vae has " + std::to_string(p.vae->config.latent_channels) +
                " latent channels, the transformer takes " + std::to_string(tc.in_channels) + " and gives " +
                std::to_string(tc.out_channels) + " (an inpainting transformer takes 2 * latents + 1)");
  if (l.hidden_size + g.hidden_size > tc.joint_attention_dim)
    throw Error(model.string() + ": text_encoder and text_encoder_2 give " + std::to_string(l.hidden_size) + " + " +
                std::to_string(g.hidden_size) + " features, more than the transformer's joint_attention_dim " +
                std::to_string(tc.joint_attention_dim));
  if (p.text_encoder_3 && p.text_encoder_3->options.d_model != tc.joint_attention_dim)
    throw Error(model.string() + ": text_encoder_3 (T5) gives " + std::to_string(p.text_encoder_3->options.d_model) +
                " features; the transformer's joint_attention_dim is " + std::to_string(tc.joint_attention_dim));
  if (p.tokenizer_3 && p.tokenizer_3->vocab_size() > p.text_encoder_3->options.vocab_size)
    throw Error(model.string() + ": tokenizer_3 has " + std::to_string(p.tokenizer_3->vocab_size()) +
                " tokens, more than text_encoder_3's vocab_size " + std::to_string(p.text_encoder_3->options.vocab_size));
  if (l.projection_dim + g.projection_dim != tc.pooled_projection_dim)
    throw Error(model.string() + ": the text encoders' projections give " + std::to_string(l.projection_dim) + " + " +
                std::to_string(g.projection_dim) + " pooled features; the transformer's pooled_projection_dim is " +
                std::to_string(tc.pooled_projection_dim));
}

// Stability's SD3 / SD3.5 single file (load_sd3_single_file). T5 loads only when it can run: a
// tokenizer (config_dir/tokenizer_3) and SentencePiece in this build; otherwise it is dropped with a warning.
void load_single(StableDiffusion3::Impl& p, const fs::path& file, const StableDiffusion3::LoadOptions& options) {
  SingleFileOptions sf;
  sf.config_dir = options.config_dir;
  const bool tokenizer_3 = !options.config_dir.empty() && fs::is_directory(options.config_dir / "tokenizer_3");
  const bool load_t5 = !options.drop_t5 && text::T5Tokenizer::available() && tokenizer_3;
  auto m = load_sd3_single_file(file, sf, load_t5);
  if (m.t5_available && !m.text_encoder_3) {
    p.t5_dropped = true;
    if (options.drop_t5)
      log::get("pipeline").info(file.string() + ": T5 dropped as asked; its part of the prompt embedding is zeros");
    else if (!text::T5Tokenizer::available())
      log::get("pipeline").warn(
          file.string() + " has a T5 text encoder, but this build of Diffract has no SentencePiece (Debian "
          "libsentencepiece-dev) for its tokenizer: it runs without T5, T5's part of the prompt embedding zeros (as "
          "diffusers with text_encoder_3=None); prompts are followed less closely than with T5");
    else
      log::get("pipeline").warn(
          file.string() + " has a T5 text encoder, but a single file carries no T5 tokenizer: give a config folder "
          "(--config) with tokenizer_3/spiece.model (SD3's diffusers folder has it). It runs without T5, T5's part "
          "of the prompt embedding zeros (as diffusers with text_encoder_3=None)");
  } else if (!m.t5_available) {
    log::get("pipeline").info(file.string() + ": no T5 text encoder in the file (nor in a config folder); T5's part "
                              "of the prompt embedding is zeros");
  }
  if (m.text_encoder_3) {
    p.tokenizer_3 = std::make_unique<text::T5Tokenizer>(text::T5Tokenizer::from_folder(m.t5_tokenizer_dir));
    p.text_encoder_3 = m.text_encoder_3;
  }
  p.transformer = m.transformer;
  p.vae = m.vae;
  p.text_encoder = m.text_encoder;
  p.text_encoder_2 = m.text_encoder_2;
  p.tokenizer = std::make_unique<text::CLIPTokenizer>(make_clip_tokenizer(m.tokenizer));
  p.tokenizer_2 = std::make_unique<text::CLIPTokenizer>(make_clip_tokenizer(m.tokenizer_2));
  if (!m.scheduler_json.empty()) p.scheduler.set_file(m.scheduler_json);
  else p.scheduler.set_text(m.scheduler_text);
  check_components(p, file);
}

}  // namespace

// Loaded or random (and on its device), its transformer's attention projections are fused and
// its linear layers may run in fp8 (a job's precision).
StableDiffusion3::StableDiffusion3(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  if (models::fused_qkv_wanted()) impl_->transformer->fuse_projections();
  models::allow_fp8(*impl_->transformer);
}
StableDiffusion3::~StableDiffusion3() = default;
int StableDiffusion3::native_size() const {
  return static_cast<int>(impl_->transformer->config.sample_size) * impl_->vae_factor();
}
bool StableDiffusion3::has_t5() const { return static_cast<bool>(impl_->text_encoder_3); }
bool StableDiffusion3::t5_dropped() const { return impl_->t5_dropped; }
int StableDiffusion3::max_sequence_length() const { return impl_->max_sequence_length; }

std::unique_ptr<StableDiffusion3> StableDiffusion3::random(bool tiny, const std::string& device) {
  const auto t0 = Clock::now();
  auto p = std::make_unique<Impl>();
  p->open(tiny ? "random-tiny-sd3" : "random-sd3-medium", device);
  auto tr_c = models::SD3Transformer2DConfig::sd3_medium();
  auto vae_c = models::AutoencoderKLConfig::sd3();
  auto te_c = models::CLIPTextConfig::clip_l(), te2_c = models::CLIPTextConfig::open_clip_bigg();
  auto taesd_c = models::TAESDConfig::taesd3();
  if (tiny) {  // the same architectures, a few channels wide: for CI
    tr_c.num_layers = 2, tr_c.num_attention_heads = 2, tr_c.attention_head_dim = 8;
    tr_c.caption_projection_dim = 16, tr_c.joint_attention_dim = 64, tr_c.pooled_projection_dim = 64;
    tr_c.sample_size = 8, tr_c.pos_embed_max_size = 16;
    te_c.hidden_size = te2_c.hidden_size = 32, te_c.intermediate_size = te2_c.intermediate_size = 64;
    te_c.num_hidden_layers = te2_c.num_hidden_layers = 2, te_c.num_attention_heads = te2_c.num_attention_heads = 2;
    te_c.projection_dim = te2_c.projection_dim = 32;
    vae_c.block_out_channels = {16, 16, 32, 32};
    vae_c.norm_num_groups = 8;
    taesd_c.encoder_block_out_channels = taesd_c.decoder_block_out_channels = {16, 16, 16, 16};
    p->max_sequence_length = 16;
  }
  p->transformer = models::SD3Transformer2DModel(tr_c);
  p->vae = models::AutoencoderKL(vae_c);
  p->text_encoder = models::CLIPTextModelWithProjection(te_c);
  p->text_encoder_2 = models::CLIPTextModelWithProjection(te2_c);
  p->taesd = models::TAESD(taesd_c, /*with_encoder=*/false);
  p->taesd_path = "<random>";
  const std::vector<torch::nn::Module*> modules = {p->transformer.get(), p->vae.get(), p->text_encoder.get(),
                                                   p->text_encoder_2.get(), p->taesd.get()};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  for (auto* m : modules) models::init_random(*m, gen);
  p->tokenizer = std::make_unique<text::CLIPTokenizer>(make_clip_tokenizer({}));
  text::CLIPTokenizerOptions bang;
  bang.pad_token = "!";
  p->tokenizer_2 = std::make_unique<text::CLIPTokenizer>(make_clip_tokenizer(bang));
  p->scheduler.set_text(R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0})");
  {
    at::NoGradGuard no_grad;
    for (auto* m : modules) {
      m->eval();
      m->to(p->device, p->dtype);
    }
  }
  if (p->device.is_cuda()) {
    models::set_memory_format(*p->taesd, at::MemoryFormat::ChannelsLast);
    at::globalContext().setBenchmarkCuDNN(true);
  }
  p->load_ms = ms_since(t0);
  return std::unique_ptr<StableDiffusion3>(new StableDiffusion3(std::move(p)));
}

std::unique_ptr<StableDiffusion3> StableDiffusion3::load(const fs::path& model, const std::string& device,
                                                         const LoadOptions& options) {
  const auto t0 = Clock::now();
  auto p = std::make_unique<Impl>();
  p->open(model, device);
  {
    const auto placement = placement_for(p->device, p->dtype);
    if (fs::is_directory(model)) {
      if (!options.config_dir.empty())
        log::get("pipeline").warn("a config folder applies to single-file checkpoints; ignored for the SD3 folder " +
                                  model.string());
      load_folder(*p, model, options);
    } else if (fs::is_regular_file(model)) {
      load_single(*p, model, options);
    } else {
      throw Error(model.string() + ": no such SD3 model folder or single file");
    }
    log_placement(placement.get(), model.string());
  }
  {
    at::NoGradGuard no_grad;
    for (torch::nn::Module* m : {static_cast<torch::nn::Module*>(p->transformer.get()),
                                 static_cast<torch::nn::Module*>(p->vae.get()),
                                 static_cast<torch::nn::Module*>(p->text_encoder.get()),
                                 static_cast<torch::nn::Module*>(p->text_encoder_2.get())}) {
      m->eval();
      m->to(p->device, p->dtype);
    }
    // bf16 on CUDA, never fp16: see T5EncoderImpl.
    if (p->text_encoder_3) p->text_encoder_3->to(p->device, p->dtype);
  }
  if (p->device.is_cuda()) at::globalContext().setBenchmarkCuDNN(true);
  p->load_ms = ms_since(t0);
  log::get("pipeline").info(log::str("loaded ", model.string(), " (sd3", p->text_encoder_3 ? ", T5" : p->t5_dropped ? ", T5 dropped" : ", no T5",
                                     ") on ", device, " in ", static_cast<int>(p->load_ms), " ms"));
  return std::unique_ptr<StableDiffusion3>(new StableDiffusion3(std::move(p)));
}

StableDiffusion3::Conditioning StableDiffusion3::encode_prompt(const std::string& prompt, const std::string& negative,
                                                               int batch, bool cfg, job::StageTimings* timings,
                                                               bool drop_t5, job::PromptSyntax syntax) {
  at::NoGradGuard no_grad;
  job::StageTimings scratch;
  auto& t = timings ? *timings : scratch;
  Conditioning c;
  const bool use_t5 = impl_->text_encoder_3 && !drop_t5;
  auto pos = impl_->encode_one(prompt, syntax, t, use_t5);
  if (cfg) {
    auto neg = impl_->encode_one(negative, syntax, t, use_t5);
    if (pos.clip.size(1) != neg.clip.size(1)) {
      const auto empty = impl_->encode_one("", syntax, t, false).clip;
      auto& shorter = pos.clip.size(1) < neg.clip.size(1) ? pos.clip : neg.clip;
      const auto missing = std::abs(pos.clip.size(1) - neg.clip.size(1)) / empty.size(1);
      shorter = at::cat({shorter, empty.repeat({1, missing, 1})}, 1);
    }
    c.negative_prompt_embeds = at::cat({neg.clip, neg.t5}, -2).repeat({batch, 1, 1});
    c.negative_pooled = neg.pooled.repeat({batch, 1});
  }
  c.prompt_embeds = at::cat({pos.clip, pos.t5}, -2).repeat({batch, 1, 1});
  c.pooled = pos.pooled.repeat({batch, 1});
  return c;
}

namespace {

struct SD3JobConditioning {
  at::Tensor context, pooled;  // [negative; prompt] with CFG
  parallel::SD3Conditioning positive, negative;
  const char* t5 = "absent";
};

}  // namespace

PipelineState& StableDiffusion3::state() { return *impl_; }
int StableDiffusion3::size_multiple() const { return impl_->size_multiple(); }
std::string StableDiffusion3::size_multiple_why() const {
  return "the VAE's factor times the transformer's patch size";
}
int StableDiffusion3::latent_channels() const { return static_cast<int>(impl_->transformer->config.out_channels); }
int StableDiffusion3::denoiser_in_channels() const { return static_cast<int>(impl_->transformer->config.in_channels); }

at::Tensor StableDiffusion3::encode_image(const at::Tensor& pixels, at::Generator& generator) {
  auto& p = *impl_;
  return p.vae->scale_latents(p.vae->encode(pixels.to(p.device, p.dtype)).sample(generator));
}
int StableDiffusion3::vae_factor() const { return impl_->vae_factor(); }
std::string StableDiffusion3::a1111_sampler(schedulers::SamplerKind) const { return "Euler, Schedule type: Simple"; }
std::string StableDiffusion3::taesd_hint() const { return "taesd3"; }
std::string StableDiffusion3::nan_hint() const { return "try fp32"; }

std::vector<adapters::LoraComponent> StableDiffusion3::lora_components() {
  auto& p = *impl_;
  return {{"transformer", p.transformer.get(), false},
          {"text_encoder", p.text_encoder.get(), true},
          {"text_encoder_2", p.text_encoder_2.get(), true}};
}

void StableDiffusion3::weights_changed() { impl_->replicas.clear(); }

job::GenerationResult StableDiffusion3::generate(const job::GenerationRequest& request, const job::JobObserver& observer,
                                                 const job::CancelToken& cancel, const at::Tensor& initial_latents) {
  JobInputs inputs;
  inputs.initial_latents = initial_latents;
  return Pipeline::generate(request, observer, cancel, inputs);
}

schedulers::SamplerKind StableDiffusion3::choose_sampler(const std::string& requested) const {
  return impl_->scheduler.choose(requested, "SD3");
}

schedulers::SchedulerConfig StableDiffusion3::scheduler_config(schedulers::SamplerKind kind) const {
  return impl_->scheduler.config(kind, impl_->path.string());
}

void StableDiffusion3::encode(JobContext& job) {
  auto& p = *impl_;
  const auto& req = job.req;
  if (!req.controlnets.empty())
    throw Error("ControlNets run with SD 1.x / 2.x / XL models; SD3's ControlNets are not supported yet");
  const auto c = encode_prompt(req.prompt, req.negative_prompt, req.batch, job.cfg, &job.timings, req.drop_t5, req.prompt_syntax);
  SD3JobConditioning j;
  j.t5 = p.text_encoder_3 && !req.drop_t5 ? "used" : p.text_encoder_3 || p.t5_dropped ? "dropped" : "absent";
  j.context = (job.cfg ? at::cat({c.negative_prompt_embeds, c.prompt_embeds}) : c.prompt_embeds).to(p.dtype);
  j.pooled = (job.cfg ? at::cat({c.negative_pooled, c.pooled}) : c.pooled).to(p.dtype);
  j.positive = {c.prompt_embeds, c.pooled};
  j.negative = {c.negative_prompt_embeds, c.negative_pooled};
  job.conditioning = std::move(j);
}

std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> StableDiffusion3::denoiser(JobContext& job) {
  auto& p = *impl_;
  const auto& c = std::any_cast<const SD3JobConditioning&>(job.conditioning);
  // Graphs or eager is decided once per job, not at every step.
  const bool graphed = p.device.is_cuda() && graphs_enabled();
  return [&p, graphed, context = c.context, pooled = c.pooled](const at::Tensor& x_in, const at::Tensor& t) {
    const auto x = x_in.to(p.dtype);
    if (graphed) return p.transformer_graph({x, context, pooled, t});
    return p.transformer->forward(x, context, pooled, t);
  };
}

std::string StableDiffusion3::profile_transformer_step(int size, int reps) {
  auto& p = *impl_;
  if (!p.device.is_cuda()) throw Error("profile_transformer_step needs a CUDA device");
  at::NoGradGuard no_grad;
  const auto opts = at::TensorOptions().device(p.device).dtype(p.dtype);
  const auto& c = p.transformer->config;
  const int64_t side = size / p.vae_factor();
  const auto x = at::randn({2, c.in_channels, side, side}, opts);
  const auto context = at::randn({2, 77 + p.max_sequence_length, c.joint_attention_dim}, opts);
  const auto pooled = at::randn({2, c.pooled_projection_dim}, opts);
  const auto t = at::full({2}, 500.0, opts);
  return step_profile(
             size, side * side / (c.patch_size * c.patch_size) + context.size(1), reps,
             [&] { p.transformer->forward(x, context, pooled, t); },
             [&] { p.transformer_graph({x, context, pooled, t}); }, p.device.index())
      .dump();
}

// CPU virtual devices share our transformer (read-only in inference); GPUs get replicas, made
// here before the ranks start (PipeFusion's hold only their stage's weights).
void StableDiffusion3::prepare_ranks(JobContext&, const parallel::Strategy& strategy, parallel::DeviceGroup& group) {
  for (int r = 0; r < group.size(); ++r) {
    const auto [stage, stages] = parallel::PipeFusion::rank_stage(strategy, r);
    impl_->transformer_on(group.device(r), stage, stages);
  }
}

std::unique_ptr<parallel::Denoiser> StableDiffusion3::rank_denoiser(const JobContext& job,
                                                                    const parallel::Strategy& strategy, int rank,
                                                                    const c10::Device& d) {
  auto& p = *impl_;
  const auto& c = std::any_cast<const SD3JobConditioning&>(job.conditioning);
  const auto [stage, stages] = parallel::PipeFusion::rank_stage(strategy, rank);
  return std::make_unique<parallel::SD3Denoiser>(p.transformer_on(d, stage, stages), c.positive, c.negative, job.req.cfg,
                                                 p.dtype, d);
}

double StableDiffusion3::warm_timestep(const JobContext&, const schedulers::Sampler& sampler) const {
  return sampler.timesteps().front();
}

at::Tensor StableDiffusion3::preview(const at::Tensor& x0, bool use_taesd, int max_side) {
  at::NoGradGuard no_grad;
  // TAESD3 decodes SD3's diffusion latents directly (see TAESDConfig).
  return use_taesd ? taesd_preview(x0, impl_->vae_factor(), max_side) : sd3_latent_rgb(x0);
}

at::Tensor StableDiffusion3::decode(const at::Tensor& latents, parallel::DeviceGroup*) {
  return impl_->decode_latents(latents);
}

void StableDiffusion3::add_metadata(const JobContext& job, nlohmann::json& meta) const {
  const auto& p = *impl_;
  meta["t5"] = std::any_cast<const SD3JobConditioning&>(job.conditioning).t5;
  meta["max_sequence_length"] = p.max_sequence_length;
  meta["shift"] = job.config.shift;
  if (!p.replicas.empty()) meta["replicas_ms"] = p.replica_ms;
}

}  // namespace diffract::pipeline
