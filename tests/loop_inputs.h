#pragma once
// The inputs of a strategy's denoising loop over tiny seeded models (test_parallel,
// test_distrifusion, test_cfg_pipefusion, test_flux_pipefusion): random text conditioning, a
// scheduler and initial noise, all from one seeded generator.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "core/models/unets/unet_2d_condition.h"
#include "core/models/transformers/flux_transformer_2d.h"
#include "core/models/transformers/sd3_transformer_2d.h"
#include "core/models/unets/unet_graphs.h"
#include "core/parallel/denoiser.h"
#include "core/parallel/strategies.h"
#include "core/schedulers/sampler.h"
#include "test_util.h"

namespace diffract::test {

struct UNetLoopInputs {
  parallel::LoopInputs in;  // make_denoiser unset
  models::UNetConditioning pos, neg;
  std::shared_ptr<models::UNetGraphRunner> unet;
};

// A UNet's loop (with SDXL's pooled text and time ids when the model takes them), the tiny-sd
// scheduler; latents [batch, C, side, side] (side 0: the model's sample size). The caller sets
// make_denoiser (plain, counting, failing: the tests differ there).
inline UNetLoopInputs unet_loop_inputs(schedulers::SamplerKind kind, int steps, int batch,
                                       const models::UNet2DConditionModel& model, std::uint64_t seed = 7,
                                       std::int64_t side = 0) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  const auto& c = model->config;
  const int64_t ctx = c.cross_attention_dim.front();
  UNetLoopInputs r;
  r.pos.encoder_hidden_states = at::randn({batch, 5, ctx}, g);
  r.neg.encoder_hidden_states = at::randn({batch, 5, ctx}, g);
  if (c.addition_embed_type == "text_time") {
    const int64_t pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim;
    r.pos.text_embeds = at::randn({batch, pooled}, g);
    r.neg.text_embeds = at::randn({batch, pooled}, g);
    r.pos.time_ids = r.neg.time_ids = at::tensor({16.0f, 16.0f, 0.0f, 0.0f, 16.0f, 16.0f}).repeat({batch, 1});
  }
  auto& in = r.in;
  in.kind = kind;
  in.config = schedulers::SchedulerConfig::from_json(fixtures() / "tiny-sd" / "scheduler" / "scheduler_config.json", kind);
  in.steps = steps;
  const auto sampler = schedulers::Sampler::create(kind, in.config, steps);
  if (side == 0) side = c.sample_size;
  in.latents = at::randn({batch, c.in_channels, side, side}, g) * sampler->init_noise_sigma();
  in.generator = g;
  r.unet = std::make_shared<models::UNetGraphRunner>(model);
  return r;
}

// Flow-matching Euler (shift 3) for `steps` steps: the transformer families' loops.
inline void flow_match_loop(parallel::LoopInputs& in, int steps) {
  in.kind = schedulers::SamplerKind::FlowMatchEuler;
  in.config = schedulers::SchedulerConfig::from_json_text(
      R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0})", in.kind,
      "test flow scheduler");
  in.steps = steps;
}

// A tiny random MMDiT (fp32, CPU): `sd35` adds SD3.5's qk-norm and dual attention in blocks 0, 1.
inline models::SD3Transformer2DModel tiny_sd3(int layers, bool sd35) {
  models::SD3Transformer2DConfig c;
  c.sample_size = 8;
  c.in_channels = c.out_channels = 4;
  c.num_layers = layers;
  c.attention_head_dim = 8;
  c.num_attention_heads = 2;
  c.joint_attention_dim = 24;
  c.caption_projection_dim = 16;
  c.pooled_projection_dim = 12;
  c.pos_embed_max_size = 16;
  if (sd35) {
    c.qk_norm = "rms_norm";
    c.dual_attention_layers = {0, 1};
  }
  models::SD3Transformer2DModel model(c);
  models::init_random(*model, at::detail::createCPUGenerator(11));
  model->eval();
  return model;
}

struct SD3LoopInputs {
  parallel::LoopInputs in;  // make_denoiser: an SD3Denoiser on the given device
  parallel::SD3Conditioning pos, neg;
};

// An SD3 loop: 6 random text tokens, flow-matching Euler (shift 3), latents [batch, C, side, side].
inline SD3LoopInputs sd3_loop_inputs(const models::SD3Transformer2DModel& model, int steps, int batch, double cfg,
                                     std::int64_t side = 16) {
  at::Generator g = at::detail::createCPUGenerator(5);
  const auto& c = model->config;
  SD3LoopInputs r;
  r.pos = {at::randn({batch, 6, c.joint_attention_dim}, g), at::randn({batch, c.pooled_projection_dim}, g)};
  r.neg = {at::randn({batch, 6, c.joint_attention_dim}, g), at::randn({batch, c.pooled_projection_dim}, g)};
  auto& in = r.in;
  flow_match_loop(in, steps);
  in.latents = at::randn({batch, c.in_channels, side, side}, g);
  in.generator = g;
  in.make_denoiser = [model, pos = r.pos, neg = r.neg, cfg](int, const c10::Device& d) -> std::unique_ptr<parallel::Denoiser> {
    return std::make_unique<parallel::SD3Denoiser>(model, pos, neg, cfg, at::kFloat, d);
  };
  return r;
}

// A tiny random Flux.1-dev transformer (fp32, CPU): `doubles` double-stream then `singles`
// single-stream blocks, 2 heads of 16 (rope 4 + 6 + 6), 16 latent channels (64 packed).
inline models::FluxTransformer2DModel tiny_flux(int doubles, int singles) {
  models::FluxTransformer2DConfig c = models::FluxTransformer2DConfig::dev();
  c.num_layers = doubles;
  c.num_single_layers = singles;
  c.attention_head_dim = 16;
  c.num_attention_heads = 2;
  c.joint_attention_dim = 24;
  c.pooled_projection_dim = 12;
  c.axes_dims_rope = {4, 6, 6};
  models::FluxTransformer2DModel model(c);
  models::init_random(*model, at::detail::createCPUGenerator(13));
  model->eval();
  return model;
}

struct FluxLoopInputs {
  parallel::LoopInputs in;  // make_denoiser: a FluxDenoiser on the given device
  parallel::FluxConditioning pos, neg;
  double guidance = 3.5;
};

// A Flux loop: 6 random text tokens, flow-matching Euler (shift 3), distilled guidance 3.5, true
// CFG at `cfg` > 1, latents [batch, 16, side, side].
inline FluxLoopInputs flux_loop_inputs(const models::FluxTransformer2DModel& model, int steps, int batch, double cfg,
                                       std::int64_t side = 16) {
  at::Generator g = at::detail::createCPUGenerator(6);
  const auto& c = model->config;
  FluxLoopInputs r;
  r.pos = {at::randn({batch, 6, c.joint_attention_dim}, g), at::randn({batch, c.pooled_projection_dim}, g)};
  r.neg = {at::randn({batch, 6, c.joint_attention_dim}, g), at::randn({batch, c.pooled_projection_dim}, g)};
  auto& in = r.in;
  flow_match_loop(in, steps);
  in.latents = at::randn({batch, c.in_channels / 4, side, side}, g);
  in.generator = g;
  in.make_denoiser = [model, pos = r.pos, neg = r.neg, cfg, guidance = r.guidance](
                         int, const c10::Device& d) -> std::unique_ptr<parallel::Denoiser> {
    return std::make_unique<parallel::FluxDenoiser>(model, pos, neg, cfg, guidance, at::kFloat, d);
  };
  return r;
}

}  // namespace diffract::test
