#pragma once
// The inputs of a strategy's denoising loop over a tiny seeded UNet (test_parallel,
// test_distrifusion): random text conditioning (with SDXL's pooled text and time ids when the
// model takes them), the tiny-sd scheduler and initial noise, all from one seeded generator.
// The caller sets make_denoiser (plain, counting, failing: the tests differ there).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "core/models/unets/unet_2d_condition.h"
#include "core/models/unets/unet_graphs.h"
#include "core/parallel/strategies.h"
#include "core/schedulers/sampler.h"
#include "test_util.h"

namespace diffract::test {

struct UNetLoopInputs {
  parallel::LoopInputs in;  // make_denoiser unset
  models::UNetConditioning pos, neg;
  std::shared_ptr<models::UNetGraphRunner> unet;
};

// Latents [batch, C, side, side] (side 0: the model's sample size).
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

}  // namespace diffract::test
