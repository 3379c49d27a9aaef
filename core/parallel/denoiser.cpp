#include "core/parallel/denoiser.h"

#include <cmath>
#include <functional>
#include <string>

#include <ATen/ATen.h>

#include "core/parallel/pipefusion.h"
#include "core/schedulers/sampler.h"
#include "core/util/error.h"

namespace diffract::parallel {

Denoiser::~Denoiser() = default;
PipeStage::~PipeStage() = default;

namespace {
[[noreturn]] void no_pipe_stages() {
  throw Error("pipefusion and cfg-pipefusion split a transformer's blocks into stages (SD3, Flux); this model has none");
}
}  // namespace

std::unique_ptr<PipeStage> Denoiser::pipe_stage(int, int, Branch, std::int64_t, std::int64_t) { no_pipe_stages(); }
std::int64_t Denoiser::pipe_weights(int, int) const { no_pipe_stages(); }

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

at::Tensor Denoiser::eval_cached(const at::Tensor&, double, Branch, models::StepCache&) {
  throw Error("this denoiser runs no step cache of that kind");
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

bool UNetDenoiser::step_cache(const models::StepCache& cache) const {
  return dynamic_cast<const models::DeepCache*>(&cache) != nullptr;
}

at::Tensor UNetDenoiser::eval_cached(const at::Tensor& model_input, double timestep, Branch branch,
                                     models::StepCache& c) {
  auto* cache = dynamic_cast<models::DeepCache*>(&c);
  if (!cache) throw Error("a UNet runs DeepCache (and the first-block cache as a DeepCache), not a transformer's cache");
  no_controlnets("DeepCache");
  const auto [shallow_down, shallow_up] = unet_->unet()->deep_cache_split(cache->branch);
  const bool by_threshold = cache->threshold >= 0;
  if (by_threshold && shallow_down < 2)
    throw Error("the first-block cache on a UNet keeps the first down layer in its shallow path: branch 1 or more");
  auto s = stage_input(model_input, timestep, branch);
  bool full = false;
  if (by_threshold) {  // conv_in, then the first down layer, whose residual decides
    run_stage(s, 0, 1, timestep, branch);
    const auto before = s.h;
    run_stage(s, 1, 2, timestep, branch);
    const auto residual = s.h - before;
    full = cache->full_step(residual);
    if (full) cache->first = residual;
    run_stage(s, 2, full ? shallow_up : shallow_down, timestep, branch);
  } else {
    full = cache->full_step();
    run_stage(s, 0, full ? shallow_up : shallow_down, timestep, branch);
  }
  if (full) cache->deep = s.h;
  else s.h = cache->deep;
  run_stage(s, shallow_up, unet_->unet()->layer_count(), timestep, branch);
  cache->reused = !full;
  if (cache->shallow_work < 0) {
    double all = 0, shallow = 0;
    const auto layers = stage_layers(model_input.size(2), model_input.size(3));
    for (std::size_t j = 0; j < layers.size(); ++j) {
      all += layers[j].cost;
      if (static_cast<int>(j) < shallow_down || static_cast<int>(j) >= shallow_up) shallow += layers[j].cost;
    }
    cache->shallow_work = all > 0 ? shallow / all : 0;
  }
  cache->reused_work = cache->shallow_work;
  return stage_output(s, branch);
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

bool TransformerDenoiser::step_cache(const models::StepCache& cache) const {
  return dynamic_cast<const models::FirstBlockCache*>(&cache) || dynamic_cast<const models::TeaCache*>(&cache);
}

at::Tensor TransformerDenoiser::eval_cached(const at::Tensor& model_input, double timestep, Branch branch,
                                            models::StepCache& cache) {
  if (!step_cache(cache))
    throw Error("the SD3 and Flux transformers run the first-block cache and TeaCache, not DeepCache (a UNet's)");
  return evaluate(model_input, timestep, branch, nullptr, &cache);
}

at::Tensor TransformerDenoiser::eval_sequence_parallel(const at::Tensor& model_input, double timestep, Branch branch,
                                                       models::SequenceExchange& exchange) {
  if (!sequence_parallel()) throw Error("this model has no sequence-parallel attention (Flux and SD3 have)");
  return evaluate(model_input, timestep, branch, &exchange, nullptr);
}

at::Tensor TransformerDenoiser::evaluate(const at::Tensor& model_input, double timestep, Branch branch,
                                         models::SequenceExchange* exchange, models::StepCache* cache) {
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
                                 models::SequenceExchange* exchange, models::StepCache* cache) {
  const auto t = at::full({x.size(0)}, timestep, at::TensorOptions().dtype(at::kFloat).device(x.device()));
  if (auto* fb = dynamic_cast<models::FirstBlockCache*>(cache)) return model_->forward_cached(x, c.context, c.pooled, t, *fb);
  if (auto* tea = dynamic_cast<models::TeaCache*>(cache)) return model_->forward_teacached(x, c.context, c.pooled, t, *tea);
  if (!exchange) return model_->forward(x, c.context, c.pooled, t);
  const int64_t p = model_->config.patch_size;
  const auto shard = models::SequenceShard::even(*exchange, c.context.size(1), (x.size(2) / p) * (x.size(3) / p));
  return model_->forward(x, c.context, c.pooled, t, &shard);
}

std::unique_ptr<Denoiser> SD3Denoiser::with(TextConditioning positive, TextConditioning negative) const {
  return std::make_unique<SD3Denoiser>(model_, std::move(positive), std::move(negative), scale(), dtype(), device());
}

namespace {

// The elements of `model`'s parameters and buffers that `keep` names.
std::int64_t count_weights(const torch::nn::Module& model, const std::function<bool(const std::string&)>& keep) {
  std::int64_t count = 0;
  for (const auto& kv : model.named_parameters(true))
    if (keep(kv.key())) count += kv.value().numel();
  for (const auto& kv : model.named_buffers(true))
    if (keep(kv.key())) count += kv.value().numel();
  return count;
}

// What the families' stages share: the blocks, the branch's conditioning, the latent's size, one
// image K/V cache per block, the embedded prompt (the head's) and the last step's time embedding.
template <class Model, class Cache>
class TransformerPipeStage : public PipeStage {
 protected:
  TransformerPipeStage(Model model, TextConditioning cond, int first, int last, int blocks, std::int64_t height,
                       std::int64_t width)
      : model_(std::move(model)), cond_(std::move(cond)), first_(first), last_(last), blocks_(blocks),
        height_(height), width_(width), caches_(static_cast<std::size_t>(last - first)) {
    if (first < 0 || last <= first || last > blocks)
      throw Error("pipefusion: blocks " + std::to_string(first) + ".." + std::to_string(last) + " of " +
                  std::to_string(blocks) + " are no stage");
  }
  bool head() const { return first_ == 0; }
  bool tail() const { return last_ == blocks_; }
  std::int64_t text() const { return cond_.context.size(1); }
  std::int64_t rows_b() const { return cond_.context.size(0); }
  const at::Tensor& context0() {
    if (!context0_.defined()) context0_ = model_->context_embedder->forward(cond_.context);
    return context0_;
  }
  // make(timestep) once per step.
  template <class Make>
  const at::Tensor& temb(double timestep, Make&& make) {
    if (!temb_.defined() || temb_step_ != timestep) {
      temb_ = make(timestep);
      temb_step_ = timestep;
    }
    return temb_;
  }
  Cache& cache(int block) { return caches_[static_cast<std::size_t>(block - first_)]; }

  Model model_;
  TextConditioning cond_;
  int first_, last_, blocks_;
  std::int64_t height_, width_;

 private:
  std::vector<Cache> caches_;
  at::Tensor context0_, temb_;
  double temb_step_ = 0;
};

// SD3: the activation is [image tokens; text tokens] of the pass; the last joint block drops the
// text stream (context_pre_only), which only the tail runs.
class SD3PipeStage final : public TransformerPipeStage<models::SD3Transformer2DModel, models::SD3BlockCache> {
 public:
  SD3PipeStage(models::SD3Transformer2DModel model, TextConditioning cond, int first, int last, std::int64_t height,
               std::int64_t width)
      : TransformerPipeStage(model, std::move(cond), first, last, static_cast<int>(model->config.num_layers), height,
                             width) {}

  at::Tensor pass(const at::Tensor& in, std::int64_t row0, std::int64_t rows, double timestep) override {
    const std::int64_t p = model_->config.patch_size, per_row = width_ / p;
    const std::int64_t tokens = (rows / p) * per_row;
    models::SD3State s;
    s.temb = temb(timestep, [&](double t) {
      return model_->time_text_embed->forward(
          at::full({rows_b()}, t, at::TensorOptions().dtype(at::kFloat).device(cond_.pooled.device())), cond_.pooled);
    });
    s.height = rows;
    s.width = width_;
    if (head()) {
      s.x = rows == height_ ? model_->pos_embed->forward(in) : model_->pos_embed->forward_rows(in, row0, height_);
      s.context = context0();
    } else {
      s.x = in.narrow(1, 0, tokens);
      s.context = in.narrow(1, tokens, text());
    }
    for (int l = first_; l < last_; ++l) model_->run_block(static_cast<std::size_t>(l), s, cache(l), (row0 / p) * per_row);
    if (tail()) return model_->unpatchify_output(s);
    return at::cat({s.x, s.context}, 1);
  }

  std::vector<std::int64_t> activation_shape(std::int64_t rows) const override {
    const std::int64_t p = model_->config.patch_size;
    return {rows_b(), (rows / p) * (width_ / p) + text(), model_->config.inner_dim()};
  }
};

}  // namespace

std::unique_ptr<PipeStage> SD3Denoiser::pipe_stage(int first, int last, Branch branch, std::int64_t height,
                                                   std::int64_t width) {
  return std::make_unique<SD3PipeStage>(model_, conditioning(branch), first, last, height, width);
}

std::int64_t SD3Denoiser::pipe_weights(int stage, int stages) const {
  const int layers = pipe_blocks();
  return count_weights(*model_, [&](const std::string& name) {
    return PipeFusion::uses_weight(name, stage, stages, layers);
  });
}

at::Tensor flux_velocity(models::FluxTransformer2DModel& model, const at::Tensor& latents, const at::Tensor& context,
                         const at::Tensor& pooled, double timestep, double guidance, models::SequenceExchange* exchange,
                         models::StepCache* cache) {
  const int64_t b = latents.size(0), h = latents.size(2), w = latents.size(3), s = context.size(1);
  const auto dt = latents.scalar_type();
  const auto opts = at::TensorOptions().device(latents.device());
  const auto t = at::full({b}, timestep, opts.dtype(dt)) / 1000;
  const auto g = model->config.guidance_embeds ? at::full({b}, guidance, opts.dtype(at::kFloat)) : at::Tensor();
  const auto rope = model->rope(at::zeros({s, 3}, opts.dtype(dt)), models::latent_image_ids(h, w, opts.dtype(dt)));
  const auto tokens = models::pack_latents(latents);
  if (auto* fb = dynamic_cast<models::FirstBlockCache*>(cache))
    return models::unpack_latents(model->forward_cached(tokens, context, pooled, t, g, rope, *fb), h, w);
  if (auto* tea = dynamic_cast<models::TeaCache*>(cache))
    return models::unpack_latents(model->forward_teacached(tokens, context, pooled, t, g, rope, *tea), h, w);
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
                                  models::SequenceExchange* exchange, models::StepCache* cache) {
  return flux_velocity(model_, x, c.context, c.pooled, timestep, guidance_, exchange, cache);
}

std::unique_ptr<Denoiser> FluxDenoiser::with(TextConditioning positive, TextConditioning negative) const {
  return std::make_unique<FluxDenoiser>(model_, std::move(positive), std::move(negative), scale(), guidance_, dtype(),
                                        device());
}

namespace {

// Flux: the activation is [text tokens; image tokens] of the pass (the single-stream blocks'
// joint order), its rope rows the text's and the patch's; timestep and guidance embedded as
// flux_velocity does.
class FluxPipeStage final : public TransformerPipeStage<models::FluxTransformer2DModel, models::ImageKV> {
 public:
  FluxPipeStage(models::FluxTransformer2DModel model, TextConditioning cond, int first, int last, std::int64_t height,
                std::int64_t width, double guidance, at::ScalarType dtype)
      : TransformerPipeStage(model, std::move(cond), first, last, static_cast<int>(model->num_blocks()), height, width),
        guidance_(guidance), dtype_(dtype) {
    const auto opts = at::TensorOptions().device(cond_.context.device()).dtype(dtype);
    rope_ = model_->rope(at::zeros({text(), 3}, opts), models::latent_image_ids(height, width, opts));
  }

  at::Tensor pass(const at::Tensor& in, std::int64_t row0, std::int64_t rows, double timestep) override {
    const std::int64_t per_row = width_ / 2, tokens = (rows / 2) * per_row, begin = (row0 / 2) * per_row;
    const std::int64_t s0 = text();
    const auto doubles = static_cast<int>(model_->transformer_blocks->size());
    models::FluxState s;
    s.temb = temb(timestep, [&](double t) {
      const auto opts = at::TensorOptions().device(cond_.pooled.device());
      const auto g = model_->config.guidance_embeds ? at::full({rows_b()}, guidance_, opts.dtype(at::kFloat))
                                                    : at::Tensor();
      return model_->time_text_embed->forward(at::full({rows_b()}, t, opts.dtype(dtype_)) / 1000, g,
                                              cond_.pooled.to(dtype_));
    });
    s.text_tokens = s0;
    const auto rope_rows = [&](const at::Tensor& r) {
      return at::cat({r.narrow(0, 0, s0), r.narrow(0, s0 + begin, tokens)});
    };
    s.rope = rows == height_ ? rope_ : models::FluxRope{rope_rows(rope_.cos), rope_rows(rope_.sin)};
    if (head()) {
      s.x = model_->x_embedder->forward(models::pack_latents(in));
      s.context = context0();
    } else if (first_ < doubles) {
      s.context = in.narrow(1, 0, s0);
      s.x = in.narrow(1, s0, tokens);
    } else {
      s.x = in;
      s.joined = true;
    }
    for (int l = first_; l < last_; ++l) model_->run_block(static_cast<std::size_t>(l), s, cache(l), begin);
    if (tail()) return models::unpack_latents(model_->output(s), rows, width_);
    return s.joined ? s.x : at::cat({s.context, s.x}, 1);
  }

  std::vector<std::int64_t> activation_shape(std::int64_t rows) const override {
    return {rows_b(), text() + (rows / 2) * (width_ / 2), model_->config.inner_dim()};
  }

 private:
  double guidance_;
  at::ScalarType dtype_;
  models::FluxRope rope_;
};

}  // namespace

std::unique_ptr<PipeStage> FluxDenoiser::pipe_stage(int first, int last, Branch branch, std::int64_t height,
                                                    std::int64_t width) {
  return std::make_unique<FluxPipeStage>(model_, conditioning(branch), first, last, height, width, guidance_, dtype());
}

std::int64_t FluxDenoiser::pipe_weights(int stage, int stages) const {
  const auto doubles = static_cast<int>(model_->transformer_blocks->size());
  const auto singles = static_cast<int>(model_->single_transformer_blocks->size());
  return count_weights(*model_, [&](const std::string& name) {
    return PipeFusion::uses_weight(name, stage, stages, doubles, singles);
  });
}

}  // namespace diffract::parallel
