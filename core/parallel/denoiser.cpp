#include "core/parallel/denoiser.h"

#include <cmath>

#include <ATen/ATen.h>

#include "core/schedulers/sampler.h"
#include "core/util/error.h"

namespace diffract::parallel {

Denoiser::~Denoiser() = default;

namespace {
[[noreturn]] void no_stages() {
  throw Error("this denoiser cannot run the layer-split stages hybrid-cfg's stale window needs (only a UNet can)");
}
}  // namespace

models::UNetOuterState Denoiser::outer_down(const at::Tensor&, double, Branch, int) { no_stages(); }
at::Tensor Denoiser::inner(const at::Tensor&, double, Branch, int) { no_stages(); }
at::Tensor Denoiser::outer_up(models::UNetOuterState, const at::Tensor&, Branch, int) { no_stages(); }

namespace {
[[noreturn]] void no_sequential_stages() {
  throw Error("this denoiser cannot run AsyncDiff's sequential stages (only an SD / SDXL UNet can be split into them)");
}
}  // namespace

std::vector<models::UNetLayerInfo> Denoiser::stage_layers(std::int64_t, std::int64_t) const { return {}; }
models::UNetStageState Denoiser::stage_input(const at::Tensor&, double, Branch) { no_sequential_stages(); }
void Denoiser::run_stage(models::UNetStageState&, int, int, double, Branch) { no_sequential_stages(); }
at::Tensor Denoiser::stage_output(const models::UNetStageState&, Branch) { no_sequential_stages(); }
std::vector<std::vector<std::int64_t>> Denoiser::stage_shapes(int, std::int64_t, std::int64_t, Branch) const {
  no_sequential_stages();
}

at::Tensor Denoiser::eval_sequence_parallel(const at::Tensor&, double, Branch, models::SequenceExchange&) {
  throw Error("this denoiser has no sequence-parallel attention (Flux's and SD3's transformers have)");
}

at::Tensor Denoiser::eval_block_cached(const at::Tensor&, double, Branch, models::FirstBlockCache&) {
  throw Error("this denoiser has no first-block cache (the SD3 and Flux transformers have)");
}

at::Tensor combine_cfg(const at::Tensor& uncond, const at::Tensor& cond, double scale) {
  return uncond + scale * (cond - uncond);
}

at::Tensor rel_mae_tensor(const at::Tensor& cond, const at::Tensor& uncond) {
  const auto den = uncond.to(at::kDouble).abs().mean();
  const auto num = (cond.to(at::kDouble) - uncond.to(at::kDouble)).abs().mean();
  return at::where(den > 0, num / den, at::zeros_like(num));
}


at::Tensor eval_at(Denoiser& d, const schedulers::Sampler& sampler, const at::Tensor& x, int step, Branch branch) {
  return d.eval(sampler.scale_model_input(x, step), sampler.timesteps().at(static_cast<std::size_t>(step)), branch);
}

namespace {
models::UNetConditioning cat_conditioning(const models::UNetConditioning& a, const models::UNetConditioning& b) {
  models::UNetConditioning c;
  c.encoder_hidden_states = at::cat({a.encoder_hidden_states, b.encoder_hidden_states});
  if (a.text_embeds.defined()) c.text_embeds = at::cat({a.text_embeds, b.text_embeds});
  if (a.time_ids.defined()) c.time_ids = at::cat({a.time_ids, b.time_ids});
  return c;
}
models::UNetConditioning narrow(const models::UNetConditioning& a, std::int64_t begin, std::int64_t count) {
  models::UNetConditioning c;
  if (!a.encoder_hidden_states.defined()) return c;
  c.encoder_hidden_states = a.encoder_hidden_states.narrow(0, begin, count);
  if (a.text_embeds.defined()) c.text_embeds = a.text_embeds.narrow(0, begin, count);
  if (a.time_ids.defined()) c.time_ids = a.time_ids.narrow(0, begin, count);
  return c;
}
}  // namespace

UNetDenoiser::UNetDenoiser(std::shared_ptr<models::UNetGraphRunner> unet, models::UNetConditioning positive,
                           models::UNetConditioning negative, double scale, at::ScalarType dtype, at::Device device)
    : unet_(std::move(unet)), positive_(std::move(positive)), negative_(std::move(negative)), scale_(scale),
      cfg_(scale > 1.0 && negative_.encoder_hidden_states.defined()), dtype_(dtype), device_(device) {
  if (cfg_) both_ = cat_conditioning(negative_, positive_);
}

at::Tensor UNetDenoiser::eval(const at::Tensor& model_input, double timestep, Branch branch) {
  if (branch == Branch::Uncond && !cfg_) throw Error("the unconditional branch was asked for without CFG");
  const bool both = branch == Branch::Guided && cfg_;
  const auto x = (both ? at::cat({model_input, model_input}) : model_input).to(device_, dtype_);
  const auto& cond = both ? both_ : branch == Branch::Uncond ? negative_ : positive_;
  auto t = at::full({x.size(0)}, timestep, at::TensorOptions().dtype(at::kFloat).device(device_));
  at::Tensor out;
  if (controls_.empty()) {
    out = unet_->forward(x, t, cond);
  } else {
    // The step whose timestep this is (the strategies evaluate steps in their own order).
    std::size_t step = 0;
    for (std::size_t i = 1; i < timesteps_.size(); ++i)
      if (std::abs(timesteps_[i] - timestep) < std::abs(timesteps_[step] - timestep)) step = i;
    auto units = controls_;
    if (both)
      for (auto& u : units) u.image = at::cat({u.image, u.image});
    out = unet_->forward(x, t, models::add_controlnet_residuals(cond, units, x, t, static_cast<int>(step),
                                                                static_cast<int>(timesteps_.size())));
  }
  if (!both) return out;
  auto parts = out.chunk(2);
  return combine_cfg(parts[0], parts[1], scale_);
}

void UNetDenoiser::set_controlnets(std::vector<models::ControlNetUnit> units, std::vector<double> timesteps) {
  for (const auto& u : units)
    if (u.image.size(0) != batch())
      throw Error("ControlNet: a control image of " + std::to_string(u.image.size(0)) + " rows for a batch of " +
                  std::to_string(batch()));
  controls_ = std::move(units);
  timesteps_ = std::move(timesteps);
}

void UNetDenoiser::no_controlnets(const char* what) const {
  if (!controls_.empty())
    throw Error(std::string("ControlNets run in whole evaluations, not in ") + what + " (run the job on one device)");
}

const models::UNetConditioning& UNetDenoiser::branch_conditioning(Branch branch) const {
  no_controlnets("a layer split");
  if (branch == Branch::Guided) throw Error("the layer-split stages run one branch (Cond or Uncond) at a time");
  if (branch == Branch::Uncond && !cfg_) throw Error("the unconditional branch was asked for without CFG");
  return branch == Branch::Uncond ? negative_ : positive_;
}

int UNetDenoiser::splits() const { return static_cast<int>(unet_->unet()->down_blocks->size()) - 1; }

models::UNetOuterState UNetDenoiser::outer_down(const at::Tensor& model_input, double timestep, Branch branch,
                                                int split) {
  const auto& cond = branch_conditioning(branch);
  const auto x = model_input.to(device_, dtype_);
  auto t = at::full({x.size(0)}, timestep, at::TensorOptions().dtype(at::kFloat).device(device_));
  return unet_->forward_outer_down(x, t, cond, split);
}

at::Tensor UNetDenoiser::inner(const at::Tensor& h, double timestep, Branch branch, int split) {
  const auto& cond = branch_conditioning(branch);
  auto t = at::full({h.size(0)}, timestep, at::TensorOptions().dtype(at::kFloat).device(device_));
  return unet_->forward_inner(h.to(device_, dtype_), t, cond, split);
}

at::Tensor UNetDenoiser::outer_up(models::UNetOuterState state, const at::Tensor& inner, Branch branch, int split) {
  return unet_->forward_outer_up(std::move(state), inner.to(device_, dtype_), branch_conditioning(branch), split);
}

const models::UNetConditioning& UNetDenoiser::conditioning(Branch branch) const {
  if (branch == Branch::Uncond && !cfg_) throw Error("the unconditional branch was asked for without CFG");
  return branch == Branch::Guided ? (cfg_ ? both_ : positive_) : branch == Branch::Uncond ? negative_ : positive_;
}

std::vector<models::UNetLayerInfo> UNetDenoiser::stage_layers(std::int64_t height, std::int64_t width) const {
  return unet_->unet()->layer_info(height, width);
}

models::UNetStageState UNetDenoiser::stage_input(const at::Tensor& model_input, double, Branch branch) {
  no_controlnets("sequential stages");
  conditioning(branch);  // checks the branch
  const bool both = branch == Branch::Guided && cfg_;
  models::UNetStageState s;
  s.h = (both ? at::cat({model_input, model_input}) : model_input).to(device_, dtype_);
  return s;
}

void UNetDenoiser::run_stage(models::UNetStageState& s, int begin, int end, double timestep, Branch branch) {
  const auto& cond = conditioning(branch);
  s.h = s.h.to(device_, dtype_);
  for (auto& k : s.skips) k = k.to(device_, dtype_);
  // The timestep as a device tensor, the time embedding made with the layers (inside their CUDA
  // graph on a GPU, so one graph serves every step).
  const auto t = at::full({s.h.size(0)}, timestep, at::TensorOptions().dtype(at::kFloat).device(device_));
  unet_->forward_range(s, begin, end, t, cond);
}

at::Tensor UNetDenoiser::stage_output(const models::UNetStageState& s, Branch branch) {
  conditioning(branch);
  if (!s.skips.empty())
    throw Error("the UNet stage state still holds " + std::to_string(s.skips.size()) +
                " skip(s): the last layer has not run");
  if (!(branch == Branch::Guided && cfg_)) return s.h;
  auto parts = s.h.chunk(2);
  return combine_cfg(parts[0], parts[1], scale_);
}

std::vector<std::vector<std::int64_t>> UNetDenoiser::stage_shapes(int layer, std::int64_t height, std::int64_t width,
                                                                  Branch branch) const {
  conditioning(branch);
  const std::int64_t rows = batch() * (branch == Branch::Guided && cfg_ ? 2 : 1);
  return unet_->unet()->stage_shapes(layer, rows, height, width);
}

std::unique_ptr<Denoiser> UNetDenoiser::rows(std::int64_t begin, std::int64_t count) const {
  if (begin < 0 || count < 1 || begin + count > batch())
    throw Error("conditioning rows " + std::to_string(begin) + "+" + std::to_string(count) + " are outside the batch of " +
                std::to_string(batch()));
  auto d = std::make_unique<UNetDenoiser>(unet_, narrow(positive_, begin, count), narrow(negative_, begin, count),
                                          scale_, dtype_, device_);
  if (!controls_.empty()) {
    std::vector<models::ControlNetUnit> units;
    for (const auto& u : controls_) units.push_back(u.rows(begin, count));
    d->set_controlnets(std::move(units), timesteps_);
  }
  return d;
}

TransformerDenoiser::TransformerDenoiser(TextConditioning positive, TextConditioning negative, double scale,
                                         at::ScalarType dtype, at::Device device)
    : positive_(std::move(positive)), negative_(std::move(negative)), scale_(scale),
      cfg_(scale > 1.0 && negative_.context.defined()), dtype_(dtype), device_(device) {
  positive_ = {positive_.context.to(device_, dtype_), positive_.pooled.to(device_, dtype_)};
  if (cfg_) {
    negative_ = {negative_.context.to(device_, dtype_), negative_.pooled.to(device_, dtype_)};
    both_ = {at::cat({negative_.context, positive_.context}), at::cat({negative_.pooled, positive_.pooled})};
  }
}

const TextConditioning& TransformerDenoiser::conditioning(Branch branch) const {
  if (branch == Branch::Uncond && !cfg_) throw Error("the unconditional branch was asked for without CFG");
  return branch == Branch::Guided ? (cfg_ ? both_ : positive_) : branch == Branch::Uncond ? negative_ : positive_;
}

at::Tensor TransformerDenoiser::eval(const at::Tensor& model_input, double timestep, Branch branch) {
  return evaluate(model_input, timestep, branch, nullptr, nullptr);
}

at::Tensor TransformerDenoiser::eval_block_cached(const at::Tensor& model_input, double timestep, Branch branch,
                                                  models::FirstBlockCache& cache) {
  return evaluate(model_input, timestep, branch, nullptr, &cache);
}

at::Tensor TransformerDenoiser::eval_sequence_parallel(const at::Tensor& model_input, double timestep, Branch branch,
                                                       models::SequenceExchange& exchange) {
  if (!sequence_parallel()) throw Error("this model has no sequence-parallel attention (Flux and SD3 have)");
  return evaluate(model_input, timestep, branch, &exchange, nullptr);
}

at::Tensor TransformerDenoiser::evaluate(const at::Tensor& model_input, double timestep, Branch branch,
                                         models::SequenceExchange* exchange, models::FirstBlockCache* cache) {
  const bool both = branch == Branch::Guided && cfg_;
  const auto& c = conditioning(branch);
  const auto x = (both ? at::cat({model_input, model_input}) : model_input).to(device_, dtype_);
  auto out = velocity(x, c, timestep, exchange, cache);
  if (!both) return out;
  auto parts = out.chunk(2);
  return combine_cfg(parts[0], parts[1], scale_);
}

std::unique_ptr<Denoiser> TransformerDenoiser::rows(std::int64_t begin, std::int64_t count) const {
  if (begin < 0 || count < 1 || begin + count > batch())
    throw Error("conditioning rows " + std::to_string(begin) + "+" + std::to_string(count) + " are outside the batch of " +
                std::to_string(batch()));
  const auto slice = [&](const TextConditioning& c) {
    if (!c.context.defined()) return TextConditioning{};
    return TextConditioning{c.context.narrow(0, begin, count), c.pooled.narrow(0, begin, count)};
  };
  return with(slice(positive_), slice(negative_));
}

SD3Denoiser::SD3Denoiser(models::SD3Transformer2DModel model, SD3Conditioning positive, SD3Conditioning negative,
                         double scale, at::ScalarType dtype, at::Device device)
    : TransformerDenoiser(std::move(positive), std::move(negative), scale, dtype, device), model_(std::move(model)) {}

at::Tensor SD3Denoiser::velocity(const at::Tensor& x, const TextConditioning& c, double timestep,
                                 models::SequenceExchange* exchange, models::FirstBlockCache* cache) {
  const auto t = at::full({x.size(0)}, timestep, at::TensorOptions().dtype(at::kFloat).device(x.device()));
  if (cache) return model_->forward_cached(x, c.context, c.pooled, t, *cache);
  if (!exchange) return model_->forward(x, c.context, c.pooled, t);
  const int64_t p = model_->config.patch_size;
  const auto shard = models::SequenceShard::even(*exchange, c.context.size(1), (x.size(2) / p) * (x.size(3) / p));
  return model_->forward(x, c.context, c.pooled, t, &shard);
}

std::unique_ptr<Denoiser> SD3Denoiser::with(TextConditioning positive, TextConditioning negative) const {
  return std::make_unique<SD3Denoiser>(model_, std::move(positive), std::move(negative), scale(), dtype(), device());
}

at::Tensor flux_velocity(models::FluxTransformer2DModel& model, const at::Tensor& latents, const at::Tensor& context,
                         const at::Tensor& pooled, double timestep, double guidance, models::SequenceExchange* exchange,
                         models::FirstBlockCache* cache) {
  const int64_t b = latents.size(0), h = latents.size(2), w = latents.size(3), s = context.size(1);
  const auto dt = latents.scalar_type();
  const auto opts = at::TensorOptions().device(latents.device());
  const auto t = at::full({b}, timestep, opts.dtype(dt)) / 1000;
  const auto g = model->config.guidance_embeds ? at::full({b}, guidance, opts.dtype(at::kFloat)) : at::Tensor();
  const auto rope = model->rope(at::zeros({s, 3}, opts.dtype(dt)), models::latent_image_ids(h, w, opts.dtype(dt)));
  const auto tokens = models::pack_latents(latents);
  if (cache) return models::unpack_latents(model->forward_cached(tokens, context, pooled, t, g, rope, *cache), h, w);
  if (!exchange) return models::unpack_latents(model->forward(tokens, context, pooled, t, g, rope), h, w);
  const auto shard = models::SequenceShard::even(*exchange, s, tokens.size(1));
  const auto rows = [&](const at::Tensor& r) {  // the text's rows and this rank's image rows
    return at::cat({r.narrow(0, 0, s), r.narrow(0, s + shard.image_begin, shard.image_tokens)});
  };
  const auto mine = model->forward(tokens.narrow(1, shard.image_begin, shard.image_tokens).contiguous(), context, pooled,
                                   t, g, {rows(rope.cos), rows(rope.sin)}, &shard);
  auto parts = exchange->all_gather(mine.contiguous());
  for (auto& p : parts) p = p.to(latents.device());
  return models::unpack_latents(at::cat(parts, 1), h, w);
}

FluxDenoiser::FluxDenoiser(models::FluxTransformer2DModel model, FluxConditioning positive, FluxConditioning negative,
                           double scale, double guidance, at::ScalarType dtype, at::Device device)
    : TransformerDenoiser(std::move(positive), std::move(negative), scale, dtype, device),
      model_(std::move(model)), guidance_(guidance) {}

at::Tensor FluxDenoiser::velocity(const at::Tensor& x, const TextConditioning& c, double timestep,
                                  models::SequenceExchange* exchange, models::FirstBlockCache* cache) {
  return flux_velocity(model_, x, c.context, c.pooled, timestep, guidance_, exchange, cache);
}

std::unique_ptr<Denoiser> FluxDenoiser::with(TextConditioning positive, TextConditioning negative) const {
  return std::make_unique<FluxDenoiser>(model_, std::move(positive), std::move(negative), scale(), guidance_, dtype(),
                                        device());
}

}  // namespace diffract::parallel
