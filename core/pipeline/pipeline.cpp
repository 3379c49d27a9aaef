#include "core/pipeline/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "core/parallel/denoiser.h"
#include "core/parallel/device_group.h"
#include "core/parallel/registry.h"
#include "core/parallel/strategy.h"
#include "core/util/build_info.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/options.h"

namespace diffract::pipeline {

using namespace detail;

void PipelineState::open(std::filesystem::path model, const std::string& device_name_) {
  path = std::move(model);
  device_name = device_name_;
  device = parse_device(device_name_);
  dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
}

Pipeline::~Pipeline() = default;
const std::filesystem::path& Pipeline::path() const { return state().path; }
const std::string& Pipeline::device() const { return state().device_name; }

std::string Pipeline::family_label() const {
  switch (family()) {
    case job::ModelFamily::SD1: return "SD 1.x";
    case job::ModelFamily::SD2: return "SD 2.x";
    case job::ModelFamily::SDXL: return "SDXL";
    case job::ModelFamily::SD3: return "SD3";
  }
  return "";
}

double Pipeline::warm_up() {
  auto& s = state();
  if (!s.device.is_cuda()) return 0;
  before_warm_up();
  const double load_ms = s.load_ms;  // the warm-up job is not a load
  const double ms = detail::warm_up(s.device_name, s.taesd ? s.taesd_path : std::string(),
                                    [&](const auto& r, const auto& o) { generate(r, o, job::CancelToken{}); });
  s.load_ms = load_ms;
  return ms;
}

double Pipeline::prepare(const job::GenerationRequest& request) {
  if (device().rfind("cuda", 0) != 0 || !request.strategy.single()) return 0;
  const int w = request.width > 0 ? request.width : native_size(), h = request.height > 0 ? request.height : native_size();
  const bool cfg = request.cfg > 1.0, previews = request.preview_every > 0;
  if (w == native_size() && h == native_size() && request.batch == 1 && cfg) return 0;  // warm_up()'s
  const std::string key = std::to_string(w) + "x" + std::to_string(h) + "x" + std::to_string(request.batch) +
                          (cfg ? " cfg " : " ") + (previews ? request.taesd : std::string());
  if (!prepared_.insert(key).second) return 0;
  const auto t0 = Clock::now();
  auto r = request;
  r.width = w;
  r.height = h;
  r.steps = 2;
  r.prompt = "warm-up";
  r.seed = 0;
  job::JobObserver o;
  if (previews) {
    r.preview_every = 1;
    o.on_preview = [](const job::PreviewEvent&) {};
  }
  generate(r, o, job::CancelToken{});
  const double ms = ms_since(t0);
  log::get("pipeline").info(log::str("prepared ", key, " in ", static_cast<int>(ms), " ms"));
  return ms;
}

at::Tensor Pipeline::taesd_preview(const at::Tensor& x0, int vae_factor, int max_side) {
  auto z = x0;
  const int64_t side = std::max(z.size(2), z.size(3)) * vae_factor;
  if (max_side > 0 && side > max_side) {
    const double s = static_cast<double>(max_side) / static_cast<double>(side);
    z = at::adaptive_avg_pool2d(z, {std::max<int64_t>(1, std::lround(z.size(2) * s)),
                                    std::max<int64_t>(1, std::lround(z.size(3) * s))});
  }
  auto& taesd = state().taesd;
  return taesd->decode(z.to(taesd->parameters().front().dtype()));
}

job::GenerationResult Pipeline::generate(const job::GenerationRequest& request, const job::JobObserver& observer,
                                         const job::CancelToken& cancel) {
  return generate(request, observer, cancel, JobInputs{});
}

namespace {

nlohmann::json timings_json(const job::StageTimings& t) {
  return {{"load", t.load_ms},        {"tokenize", t.tokenize_ms},   {"text_encode", t.text_encode_ms},
          {"steps", t.step_ms},       {"previews", t.preview_ms},    {"previews_dropped", t.previews_dropped},
          {"vae_decode", t.vae_decode_ms}, {"total", t.total_ms}};
}

}  // namespace

job::GenerationResult Pipeline::generate(const job::GenerationRequest& request, const job::JobObserver& observer,
                                         const job::CancelToken& cancel, const JobInputs& inputs) {
  auto& s = state();
  const auto start = Clock::now();
  job::GenerationResult result;
  result.request = request;
  auto& req = result.request;
  auto& timings = result.timings;
  const auto fam = family();
  result.family = std::string(job::family_name(fam));
  options::check_overrides(req.options);
  const options::JobOptionsScope job_options(req.options);

  // Everything a user can get wrong is checked before any work starts; the model's load time
  // goes to the first job that gets past the checks. The registry checks the family; each
  // strategy's validate() says best why it needs CFG or more devices.
  const bool cfg = req.cfg > 1.0;
  std::unique_ptr<parallel::Strategy> made;
  const parallel::Strategy* strategy = inputs.strategy;
  if (strategy) {
    job::StrategyParams named;
    named.name = strategy->name();
    parallel::check_strategy(named, fam, /*cfg=*/true);
  } else if (!req.strategy.single()) {
    parallel::check_strategy(req.strategy, fam, /*cfg=*/true);
    made = parallel::make_strategy(req.strategy);
    strategy = made.get();
  }
  if (strategy) strategy->validate(req.batch, cfg);
  check_request(req, native_size(), size_multiple(), size_multiple_why());
  const auto kind = choose_sampler(req.sampler);
  req.sampler = std::string(schedulers::sampler_name(kind));
  const auto config = scheduler_config(kind);
  check_steps(req, config.num_train_timesteps);
  auto sampler = schedulers::Sampler::create(kind, config, req.steps);

  const std::vector<int64_t> shape{req.batch, latent_channels(), req.height / vae_factor(), req.width / vae_factor()};
  if (inputs.initial_latents.defined() && inputs.initial_latents.sizes().vec() != shape)
    throw Error("initial latents of shape " + c10::str(inputs.initial_latents.sizes()) + " for a job that needs " +
                c10::str(at::IntArrayRef(shape)));

  // The last TAESD stays loaded for later jobs that name it again.
  if (!req.taesd.empty() && req.taesd != s.taesd_path) {
    auto taesd = models::load_taesd(req.taesd);
    if (!taesd->has_decoder()) throw Error(req.taesd + ": the TAESD has no decoder");
    if (taesd->config.latent_channels != latent_channels())
      throw Error(req.taesd + ": a TAESD of " + std::to_string(taesd->config.latent_channels) +
                  " latent channels cannot preview " + family_label() + "'s " + std::to_string(latent_channels()) +
                  " (use " + taesd_hint() + ")");
    taesd->eval();
    taesd->to(s.device, s.dtype);
    if (s.device.is_cuda()) models::set_memory_format(*taesd, at::MemoryFormat::ChannelsLast);
    s.taesd = taesd;
    s.taesd_path = req.taesd;
  }
  timings.load_ms = std::exchange(s.load_ms, 0.0);

  at::NoGradGuard no_grad;
  JobContext job{req, timings};
  job.kind = kind;
  job.config = config;
  job.cfg = cfg;
  job.use_taesd = !req.taesd.empty();
  const auto stage = [&](const char* name, double ms) {
    if (observer.on_stage) observer.on_stage(name, ms);
  };
  encode(job);
  stage("tokenize", timings.tokenize_ms);
  stage("text_encode", timings.text_encode_ms);

  // Initial noise comes from a CPU generator, drawn in the model's dtype as diffusers'
  // randn_tensor does, so a seed gives diffusers' latents at the same precision.
  at::Generator gen = at::detail::createCPUGenerator(req.seed);
  at::Tensor latents = inputs.initial_latents.defined() ? inputs.initial_latents.to(s.device, s.dtype)
                                                        : at::randn(shape, gen, s.dtype).to(s.device);
  latents = latents * sampler->init_noise_sigma();

  const StepReporter::Preview preview_fn = [this, use_taesd = job.use_taesd, max_side = req.preview_side()](
                                               const at::Tensor& x0) { return preview(x0, use_taesd, max_side); };
  parallel::LoopStats strategy_stats;
  parallel::DeviceGroup* group = nullptr;  // a strategy's group also decodes the latents
  const auto before_strategy = Clock::now();
  if (strategy) {
    group = &s.groups.group_for(s.device, *strategy, req.gpus);
    prepare_ranks(job, *strategy, *group);
    parallel::LoopInputs in;
    in.kind = kind;
    in.config = config;
    in.steps = req.steps;
    in.latents = latents;
    in.generator = gen;
    in.cancel = &cancel;
    in.make_denoiser = [this, &job, strategy](int rank, const c10::Device& d) {
      return rank_denoiser(job, *strategy, rank, d);
    };
    latents = run_strategy_loop(*strategy, *group, std::move(in), latents.to(s.dtype), warm_timestep(job, *sampler),
                                req, observer, preview_fn, timings, strategy_stats);
  } else {
    StepReporter reporter(s.device, req, observer, *sampler, preview_fn, timings);
    latents = denoise(*sampler, latents, gen, req.cfg, denoiser(job), reporter, cancel, nan_hint());
  }
  const double strategy_call_ms = ms_since(before_strategy);
  if (!at::isfinite(latents).all().item<bool>())
    throw Error("the final latents hold NaN or Inf: the model's weights or settings are broken");
  if (cancel.cancelled()) throw job::Cancelled{};

  const auto td = Clock::now();
  auto images = decode(latents, group);
  if (!at::isfinite(images).all().item<bool>())
    throw Error("the VAE decode produced NaN or Inf (an fp16 overflow? the VAE may need fp32)");
  result.images = to_images(images);
  timings.vae_decode_ms = ms_since(td);
  stage("vae_decode", timings.vae_decode_ms);
  timings.total_ms = ms_since(start) + timings.load_ms;
  stage("total", timings.total_ms);

  result.a1111_parameters = req.prompt + "\nNegative prompt: " + req.negative_prompt + "\nSteps: " +
                            std::to_string(req.steps) + ", Sampler: " + a1111_sampler(kind) +
                            ", CFG scale: " + format_number(req.cfg) + ", Seed: " + std::to_string(req.seed) +
                            ", Size: " + std::to_string(req.width) + "x" + std::to_string(req.height) +
                            ", Model: " + s.path.filename().string() + ", Version: Diffract " +
                            build_info().diffract_version;
  nlohmann::json meta = {
      {"diffract_version", build_info().diffract_version},
      {"model", s.path.string()}, {"family", result.family},
      {"prompt", req.prompt}, {"negative_prompt", req.negative_prompt},
      {"width", req.width}, {"height", req.height}, {"steps", req.steps}, {"cfg", req.cfg},
      {"seed", req.seed}, {"sampler", req.sampler}, {"device", req.device}, {"batch", req.batch},
      {"taesd", req.taesd}, {"strategy_name", strategy ? strategy->name() : std::string("single")},
      {"devices", strategy ? strategy->devices() : 1},
      {"initial_latents", inputs.initial_latents.defined() ? "given" : "seed"},
      {"timings_ms", timings_json(timings)},
  };
  if (!req.options.empty()) meta["options"] = req.options;
  if (strategy) {
    if (req.strategy.name == strategy->name() && parallel::strategy_info(req.strategy.name).takes(parallel::Param::Skip))
      meta["skip"] = req.strategy.skip;
    // From the job's start to the strategy's call (text encoding, latents), the whole call, and
    // from its return to the VAE decode (the finite check): against loop_ms, setup_ms, finish_ms.
    strategy_stats.before_call_ms = std::chrono::duration<double, std::milli>(before_strategy - start).count();
    strategy_stats.call_ms = strategy_call_ms;
    strategy_stats.after_call_ms =
        std::chrono::duration<double, std::milli>(td - before_strategy).count() - strategy_call_ms;
    meta["strategy"] = strategy_stats.json();
  }
  add_metadata(job, meta);
  result.metadata_json = meta.dump();
  const auto cpu_latents = latents.to(at::kCPU, at::kFloat).contiguous();
  result.latents.assign(cpu_latents.data_ptr<float>(), cpu_latents.data_ptr<float>() + cpu_latents.numel());
  result.latents_shape = cpu_latents.sizes().vec();
  return result;
}

}  // namespace diffract::pipeline
