#include "core/pipeline/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/ScopeExit.h>

#include "core/models/common/cancel_point.h"
#include "core/models/common/fp8_linear.h"
#include "core/models/common/layers.h"
#include "core/parallel/denoiser.h"
#include "core/parallel/device_group.h"
#include "core/parallel/registry.h"
#include "core/parallel/strategy.h"
#include "core/pipeline/image_processor.h"
#include "core/text/prompt_syntax.h"
#include "core/util/build_info.h"
#include "core/util/device_work.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/options.h"
#include "core/util/torch_errors.h"

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

namespace {
// A1111's ", Lora hashes: "name: hash, ..."" for the LoRAs applied ("" when none has a hash).
std::string lora_hashes(const std::vector<adapters::AppliedLora>& applied) {
  std::string list;
  for (const auto& a : applied) {
    if (a.hash.empty()) continue;
    const auto name = a.ref.name.empty() ? std::filesystem::path(a.ref.path).stem().string() : a.ref.name;
    list += (list.empty() ? "" : ", ") + name + ": " + a.hash;
  }
  return list.empty() ? "" : ", Lora hashes: \"" + list + "\"";
}
}  // namespace

io::LoraModelModules Pipeline::lora_modules() { return adapters::lora_modules(lora_components()); }

std::string Pipeline::family_label() const {
  switch (family()) {
    case job::ModelFamily::SD1: return "SD 1.x";
    case job::ModelFamily::SD2: return "SD 2.x";
    case job::ModelFamily::SDXL: return "SDXL";
    case job::ModelFamily::SD3: return "SD3";
    case job::ModelFamily::Flux: return "Flux.1";
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

at::Tensor Pipeline::preview_latents(const at::Tensor& x0, int vae_factor, int max_side) {
  const int64_t side = std::max(x0.size(2), x0.size(3)) * vae_factor;
  if (max_side <= 0 || side <= max_side) return x0;
  const double s = static_cast<double>(max_side) / static_cast<double>(side);
  return at::adaptive_avg_pool2d(x0, {std::max<int64_t>(1, std::lround(x0.size(2) * s)),
                                      std::max<int64_t>(1, std::lround(x0.size(3) * s))});
}

at::Tensor Pipeline::taesd_preview(const at::Tensor& x0, int vae_factor, int max_side) {
  auto& taesd = state().taesd;
  return taesd->decode(preview_latents(x0, vae_factor, max_side).to(taesd->parameters().front().dtype()));
}

job::GenerationResult Pipeline::generate(const job::GenerationRequest& request, const job::JobObserver& observer,
                                         const job::CancelToken& cancel) {
  return generate(request, observer, cancel, JobInputs{});
}

namespace {

nlohmann::json timings_json(const job::StageTimings& t) {
  return {{"load", t.load_ms},        {"tokenize", t.tokenize_ms},   {"text_encode", t.text_encode_ms},
          {"steps", t.step_ms},       {"previews", t.preview_ms},    {"previews_dropped", t.previews_dropped},
          {"vae_encode", t.vae_encode_ms}, {"vae_decode", t.vae_decode_ms}, {"total", t.total_ms}};
}


using EncodeImage = std::function<at::Tensor(const at::Tensor& pixels, at::Generator& gen)>;

// An inpainting model's extra input without a mask: everything is repainted and the masked image
// is mid-grey (as A1111 runs inpainting models without one); its posterior is drawn apart from
// the job's generator.
at::Tensor repaint_all_channels(const std::vector<int64_t>& shape, int vae_factor, const at::Device& device,
                                at::ScalarType dtype, const EncodeImage& encode) {
  at::Generator apart = at::detail::createCPUGenerator(0);
  const auto grey = encode(at::zeros({1, 3, shape[2] * vae_factor, shape[3] * vae_factor}), apart);
  return at::cat({at::ones({shape[0], 1, shape[2], shape[3]}, at::TensorOptions().device(device).dtype(dtype)),
                  grey.to(device, dtype).repeat({shape[0], 1, 1, 1})}, 1);
}

// The denoiser with an inpainting model's extra channels after the latents (the CFG halves share them).
std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> with_mask_channels(
    std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> model, const at::Tensor& extra) {
  if (!extra.defined()) return model;
  // Both batch sizes a step can ask for, made once: the job's, and both CFG halves.
  return [inner = std::move(model), extra, both = at::cat({extra, extra})](const at::Tensor& x, const at::Tensor& t) {
    const auto& e = x.size(0) == extra.size(0) ? extra : both;
    if (x.size(0) != e.size(0)) throw Error("an inpainting model's mask channels for batch " + std::to_string(x.size(0)));
    return inner(at::cat({x, e.to(x.scalar_type())}, 1), t);
  };
}

// The hires pass's schedule length, and the steps of it that run (0 without the fix).
int hires_schedule(const job::GenerationRequest& req) { return req.hires.steps > 0 ? req.hires.steps : req.steps; }
int hires_steps_run(const job::GenerationRequest& req) {
  if (!req.hires.enabled()) return 0;
  const int steps = hires_schedule(req);
  return std::min(static_cast<int>(steps * req.hires.strength), steps);
}

// The hires pass's size: the job's times the scale, rounded to the size multiple.
std::pair<int, int> hires_size(const job::GenerationRequest& req, int multiple) {
  const auto side = [&](int v) {
    return std::max(multiple, static_cast<int>(std::lround(v * req.hires.scale / multiple)) * multiple);
  };
  return {side(req.width), side(req.height)};
}

// What a job's loop starts from.
struct StartInputs {
  const schedulers::Sampler& sampler;
  at::Generator& gen;
  const std::vector<int64_t>& shape;  // [batch, C, h, w]
  at::Device device;
  at::ScalarType dtype;
  const at::Tensor& given_noise;      // JobInputs::initial_latents, or undefined
  int first_step;
  double strength;
  bool inpaint_model;                 // the denoiser takes the mask and the masked image's latents
  int vae_factor;
};

struct StartingPoint {
  at::Tensor latents;
  LoopImage loop;
  at::Tensor mask_channels;  // an inpainting model's extra input: [batch, 1 + C, h, w]
};

// The initial latents as diffusers' pipelines make them: noise times init_noise_sigma for text-to-
// image; for image inputs the generator's draws in their order (the image's latents when they are
// used, the noise, the masked image's latents), the image noised to the first step's level, or pure
// noise when an inpainting job repaints at strength 1.
StartingPoint starting_point(const StartInputs& in, const PreparedInputs* prepared, const EncodeImage& encode) {
  const int64_t batch = in.shape[0];
  const auto noise = [&] {
    return in.given_noise.defined() ? in.given_noise.to(in.device, in.dtype)
                                    : at::randn(in.shape, in.gen, in.dtype).to(in.device);
  };
  const auto batched = [&](const at::Tensor& x) { return x.to(in.device, in.dtype).repeat({batch, 1, 1, 1}); };
  StartingPoint sp;
  sp.loop.first_step = in.first_step;
  if (!prepared) {
    sp.latents = noise() * in.sampler.init_noise_sigma();
  } else {
    const bool masked = prepared->mask.defined(), blend = masked && !in.inpaint_model;
    const bool strength_max = in.strength == 1.0;
    at::Tensor image_latents;
    if (!masked || blend || !strength_max) image_latents = batched(encode(prepared->pixels, in.gen));
    const auto n = noise();
    sp.latents = masked && strength_max ? n * in.sampler.init_noise_sigma()
                                        : in.sampler.add_noise(image_latents, n, in.first_step);
    if (masked) {
      const auto mask = batched(at::upsample_nearest2d(prepared->mask, {in.shape[2], in.shape[3]}));
      if (in.inpaint_model) {
        const auto masked_pixels = prepared->pixels * (prepared->mask < 0.5);
        sp.mask_channels = at::cat({mask, batched(encode(masked_pixels, in.gen))}, 1);
      } else {
        // diffusers encodes the masked image for these models too and never uses it: only its
        // draw is kept, so that later draws (ancestral samplers) stay in step.
        at::randn({1, in.shape[1], in.shape[2], in.shape[3]}, in.gen, in.dtype);
        sp.loop.mask = mask;
        sp.loop.image_latents = image_latents;
        sp.loop.noise = n;
      }
    }
  }
  if (in.inpaint_model && !sp.mask_channels.defined())
    sp.mask_channels = repaint_all_channels(in.shape, in.vae_factor, in.device, in.dtype, encode);
  return sp;
}

nlohmann::json input_json(const job::ImageInputs& in, const PreparedInputs& p, double strength, int steps_run,
                          bool inpaint_model) {
  nlohmann::json j = {{"image", std::to_string(in.image.width) + "x" + std::to_string(in.image.height)},
                      {"strength", strength},
                      {"steps_run", steps_run},
                      {"mask", in.has_mask()}};
  if (in.has_mask()) {
    j["inpainting"] = inpaint_model ? "mask channels" : "latent blend";
    j["mask_blur"] = in.mask_blur;
    j["full_res_padding"] = in.full_res_padding;
    if (p.cropped) j["crop"] = {p.crop_box.x1, p.crop_box.y1, p.crop_box.x2, p.crop_box.y2};
    j["paste_back"] = in.paste_back;
  }
  if (!p.notes.empty()) j["notes"] = p.notes;
  return j;
}
}  // namespace

at::Tensor Pipeline::hires_pass(JobContext& job, const at::Tensor& latents, at::Generator& gen, bool inpaint_model,
                                const job::JobObserver& observer, const StepReporter::Preview& preview,
                                const job::CancelToken& cancel) {
  auto& s = state();
  auto& req = job.req;
  const auto& h = req.hires;
  const auto [w, ht] = hires_size(req, size_multiple());
  const int f = vae_factor();
  const auto encode_fn = [this](const at::Tensor& x, at::Generator& g) { return encode_image(x, g); };
  at::Tensor start;
  if (h.upscaler == "latent") {
    start = at::upsample_bicubic2d(latents.to(at::kFloat), {ht / f, w / f}, /*align_corners=*/false).to(s.dtype);
  } else {
    // Through 8-bit pixels, as an upscaled image would be.
    std::vector<at::Tensor> encoded;
    for (const auto& img : to_images(decode(latents, nullptr)))
      encoded.push_back(encode_image(image_tensor(resize_lanczos(img, w, ht)), gen));
    start = at::cat(encoded).to(s.device, s.dtype);
  }
  req.width = w;
  req.height = ht;
  encode(job);  // conditioning that depends on the size (SDXL's time ids)
  fit_schedule(job.config, w, ht);
  const int steps = hires_schedule(req);
  auto sampler = schedulers::Sampler::create(job.kind, job.config, steps);
  const int first = steps - hires_steps_run(req);
  if (first == steps) return start;
  const auto noise = at::randn(start.sizes(), gen, s.dtype).to(s.device);
  auto x = sampler->add_noise(start, noise, first);
  const auto extra = inpaint_model ? repaint_all_channels(start.sizes().vec(), f, s.device, s.dtype, encode_fn)
                                   : at::Tensor();
  const int run_before = static_cast<int>(job.timings.step_ms.size());
  StepReporter reporter(s.device, req, observer, *sampler, preview, job.timings, first, run_before,
                        run_before + steps - first);
  LoopImage from;
  from.first_step = first;
  job.run_timesteps.assign(sampler->timesteps().begin() + first, sampler->timesteps().end());
  return denoise(*sampler, x, gen, req.cfg, with_mask_channels(denoiser(job), extra), reporter, cancel, nan_hint(), from);
}

job::GenerationResult Pipeline::generate(const job::GenerationRequest& request, const job::JobObserver& observer,
                                         const job::CancelToken& cancel, const JobInputs& inputs) {
  // Where the job was should memory run out: the last stage it finished, the steps it made.
  std::string stage = "before its first stage";
  int steps = 0;
  auto watched = observer;
  watched.on_stage = [&stage, inner = observer.on_stage](const std::string& name, double ms) {
    stage = "after " + name;
    if (inner) inner(name, ms);
  };
  watched.on_step = [&steps, inner = observer.on_step](const job::StepEvent& e) {
    ++steps;
    if (inner) inner(e);
  };
  // What ran out, where the job was and its size; the caches of every device are emptied first.
  const auto out_of_memory = [&](const std::string& device, const std::string& why) {
    release_cached_memory();
    const std::string size = request.width && request.height
                                 ? std::to_string(request.width) + "x" + std::to_string(request.height)
                                 : "native size";
    return Error("out of memory on " + device + " (" + stage +
                 (steps ? ", " + std::to_string(steps) + " steps done" : std::string()) + "; " + size + ", batch " +
                 std::to_string(request.batch) + (request.strategy.name.empty() ? "" : ", " + request.strategy.name) +
                 "): " + why + ". What the job held is freed; try a smaller size or batch, or another device");
  };
  try {
    auto result = run_job(request, watched, cancel, inputs);
    models::save_tuning();  // shapes this job tuned, for the next process (io/tuning_store.h)
    return result;
  } catch (const parallel::DeviceOutOfMemory& e) {  // a rank of a multi-device strategy
    throw out_of_memory(e.device(), e.why());
  } catch (const std::exception& e) {
    if (const auto why = out_of_memory_reason(e)) throw out_of_memory(request.device, *why);
    throw;
  }
}

job::GenerationResult Pipeline::run_job(const job::GenerationRequest& request, const job::JobObserver& observer,
                                        const job::CancelToken& cancel, const JobInputs& inputs) {
  auto& s = state();
  const auto start = Clock::now();
  job::GenerationResult result;
  result.request = request;
  auto& req = result.request;
  auto& timings = result.timings;
  const auto fam = family();
  result.family = std::string(job::family_name(fam));
  // The request's precision rides on the job's options (DIFFRACT_PRECISION), which the ranks of a
  // strategy take too.
  auto job_overrides = req.options;
  if (!req.precision.empty()) {
    if (req.precision != "bf16" && req.precision != "fp8")
      throw Error("precision '" + req.precision.substr(0, 40) + "' is neither bf16 nor fp8");
    job_overrides["DIFFRACT_PRECISION"] = req.precision;
  }
  options::check_overrides(job_overrides);
  const options::JobOptionsScope job_options(job_overrides);
  // The models' blocks stop a long step within a block once the job is cancelled.
  const models::CancelScope cancel_scope(&cancel);
  // The e4m3 rows a job's kernels offered and no layer took are not kept past it (fp8_linear.h).
  const auto drop_fp8_rows = c10::make_scope_exit([] { models::drop_fp8_rows(); });
  if (models::fp8_wanted() && !s.device.is_cuda())
    log::get("pipeline").info("fp8 on the CPU is emulated in fp32: it shows fp8's rounding, not its speed");

  // Everything a user can get wrong is checked before any work starts; the model's load time
  // goes to the first job that gets past the checks. The registry checks the family; each
  // strategy's validate() says best why it needs CFG or more devices.
  const bool cfg = guided(req);
  if (!cfg && req.cfg > 1.0) {
    log::get("pipeline").info("CFG " + format_number(req.cfg) + " asked, but " + family_label() +
                              " runs true CFG only with a negative prompt: this job runs without CFG");
    req.cfg = 1.0;
  }
  const bool image_job = req.input.has_image();
  if (req.input.has_mask() && !image_job) throw Error("a mask needs an init image to inpaint");
  nlohmann::json outpaint;
  if (req.input.outpaints()) {
    if (!image_job) throw Error("outpainting needs an init image to extend");
    const auto& i = req.input;
    outpaint = {{"margins", {i.outpaint_left, i.outpaint_top, i.outpaint_right, i.outpaint_bottom}},
                {"fill", i.outpaint_fill}, {"overlap", i.outpaint_overlap},
                {"image", std::to_string(i.image.width) + "x" + std::to_string(i.image.height)}};
    extend_canvas(req.input);  // from here on an inpainting job on the grown canvas
  }
  const double strength = image_job ? req.input.resolved_strength() : 1.0;
  if (image_job) {
    if (!(strength >= 0.0 && strength <= 1.0))
      throw Error("strength " + format_number(strength) + " is outside 0..1 (0 keeps the image, 1 repaints it all)");
    // The job's size defaults to the image's, cut down to the size multiple (diffusers' img2img);
    // inpainting at full resolution generates the mask's region at the model's native size.
    const int m = size_multiple();
    if (req.input.full_res_padding < 0) {
      if (req.width == 0) req.width = req.input.image.width / m * m;
      if (req.height == 0) req.height = req.input.image.height / m * m;
      if (req.width == 0 || req.height == 0)
        throw Error("the init image (" + std::to_string(req.input.image.width) + "x" +
                    std::to_string(req.input.image.height) + ") is smaller than " + std::to_string(m) +
                    " pixels a side; give the job's size");
    }
  }
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
  if (strategy && image_job) parallel::check_image_inputs(strategy->name(), req.input.has_mask());
  if (req.hires.enabled()) {
    const auto& h = req.hires;
    if (!(h.scale > 1.0 && h.scale <= 4.0)) throw Error("hires scale " + format_number(h.scale) + " must be above 1, at most 4");
    if (!(h.strength >= 0.0 && h.strength <= 1.0)) throw Error("hires strength " + format_number(h.strength) + " is outside 0..1");
    if (h.upscaler != "latent" && h.upscaler != "lanczos")
      throw Error("hires upscaler '" + h.upscaler + "': expected latent or lanczos");
    if (h.steps < 0 || h.steps > 1000) throw Error("hires steps must be 0 (the job's) to 1000");
    if (strategy) throw Error("the hires fix runs on one device: run it without a strategy (single)");
    if (req.input.has_mask()) throw Error("the hires fix is for text-to-image and image-to-image jobs, not inpainting");
  }
  check_request(req, native_size(), size_multiple(), size_multiple_why());
  const int base_width = req.width, base_height = req.height;  // the first pass's size
  if (req.hires.enabled()) {
    const auto [w, h] = hires_size(req, size_multiple());
    if (w > 8192 || h > 8192)
      throw Error("the hires fix's " + std::to_string(w) + "x" + std::to_string(h) + " is above 8192 pixels a side");
  }
  const auto kind = choose_sampler(req.sampler);
  req.sampler = std::string(schedulers::sampler_name(kind));
  auto config = scheduler_config(kind);
  fit_schedule(config, req.width, req.height);
  check_steps(req, config.num_train_timesteps);
  auto sampler = schedulers::Sampler::create(kind, config, req.steps);
  // diffusers' get_timesteps: the last int(steps * strength) steps run.
  const int first_step = image_job ? req.steps - std::min(static_cast<int>(req.steps * strength), req.steps) : 0;
  const bool inpaint_model = denoiser_in_channels() == 2 * latent_channels() + 1;
  if (!inpaint_model && denoiser_in_channels() != latent_channels())
    throw Error("the model's denoiser takes " + std::to_string(denoiser_in_channels()) + " channels: neither its " +
                std::to_string(latent_channels()) + " latent channels nor an inpainting model's " +
                std::to_string(2 * latent_channels() + 1));
  for (std::size_t i = 0; i < req.controlnets.size(); ++i) {
    const auto& c = req.controlnets[i];
    const auto what = "ControlNet " + std::to_string(i + 1) + " (" + c.path + ")";
    if (c.image.width <= 0 || c.image.height <= 0) throw Error(what + " has no control image");
    if (!std::isfinite(c.scale)) throw Error(what + ": its scale is not a number");
    if (!(c.start >= 0 && c.start < c.end && c.end <= 1))
      throw Error(what + ": start " + format_number(c.start) + " and end " + format_number(c.end) +
                  " must satisfy 0 <= start < end <= 1 (fractions of the steps)");
  }
  if (!req.controlnets.empty() && strategy) parallel::check_controlnets(strategy->name());
  if (!req.controlnets.empty() && req.hires.enabled())
    throw Error("the hires fix with ControlNets is not supported yet (its second pass would need the control images "
                "at the larger size): turn one of them off");
  if (!req.controlnets.empty() && inpaint_model)
    throw Error("ControlNets with an inpainting model (its " + std::to_string(denoiser_in_channels()) +
                "-channel UNet) are not supported: use the base model, which inpaints by blending");
  if (strategy && inpaint_model)
    throw Error("strategy " + strategy->name() + " cannot run an inpainting model (its " +
                std::to_string(denoiser_in_channels()) + "-channel denoiser takes the mask, which the ranks are not "
                "given): run it on one device (single)");
  PreparedInputs prepared;
  if (image_job) {
    prepared = prepare_inputs(req.input, req.width, req.height);
    for (const auto& note : prepared.notes) log::get("pipeline").info(note);
  }

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
  // LoRAs: --lora files, and the prompt's <lora:NAME:W> tags, which the engine resolved into
  // req.loras by name; the tags are not encoded, and the parameters text keeps them as written
  // (with tags added for the --lora files), as A1111 writes its prompts.
  const std::string written_prompt = req.prompt;
  std::string lora_tags;
  if (req.prompt_syntax == job::PromptSyntax::A1111) {
    auto extracted = text::extract_extra_networks(req.prompt);
    for (const auto& tag : extracted.tags)
      if (std::none_of(req.loras.begin(), req.loras.end(), [&](const job::LoraRef& l) { return l.name == tag.name; }))
        throw Error("the prompt's " + tag.text + " names a LoRA that was not looked up (run the job through the engine, "
                    "which finds <lora:NAME> in the LoRA folders)");
    for (const auto& l : req.loras)
      if (std::none_of(extracted.tags.begin(), extracted.tags.end(), [&](const auto& t) { return t.name == l.name; }))
        lora_tags += " <lora:" + (l.name.empty() ? std::filesystem::path(l.path).stem().string() : l.name) + ":" +
                     format_number(l.weight) + ">";
    req.prompt = extracted.prompt;
  } else if (!req.loras.empty()) {
    for (const auto& l : req.loras) lora_tags += " <lora:" + std::filesystem::path(l.path).stem().string() + ":" + format_number(l.weight) + ">";
  }
  const bool loras_changed = s.loras.apply(req.loras, lora_components(), req.lora_lenient);
  if (loras_changed) {
    models::invalidate_fp8_weights();
    weights_changed();
    log::get("pipeline").info(log::str("LoRAs ", req.loras.empty() ? "removed" : "applied", " in ",
                                       static_cast<int>(s.loras.last_apply_ms()), " ms"));
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
  const auto preview_fn = StepReporter::Preview(
      [this, use_taesd = job.use_taesd, max_side = req.preview_side()](const at::Tensor& x0) {
        return preview(x0, use_taesd, max_side);
      });
  parallel::LoopStats strategy_stats;
  parallel::DeviceGroup* group = nullptr;  // a strategy's group also decodes the latents
  auto before_strategy = Clock::now(), td = before_strategy;
  double strategy_call_ms = 0;
  at::Tensor latents;
  // A strength that leaves no step to run (0, or too small for the step count) gives the input back.
  const bool no_steps = image_job && first_step == req.steps;
  encode(job);  // also without steps: the family's metadata describes the conditioning
  stage("tokenize", timings.tokenize_ms);
  stage("text_encode", timings.text_encode_ms);
  if (no_steps) {
    result.images.assign(static_cast<size_t>(req.batch), prepared.cropped ? prepared.original : prepared.image);
  } else {

    // Initial noise comes from a CPU generator, drawn in the model's dtype as diffusers'
    // randn_tensor does, so a seed gives diffusers' latents at the same precision.
    at::Generator gen = at::detail::createCPUGenerator(req.seed);
    StartInputs si{*sampler, gen, shape, s.device, s.dtype, inputs.initial_latents, first_step, strength, inpaint_model,
                   vae_factor()};
    const auto encode_fn = [this](const at::Tensor& x, at::Generator& g) { return encode_image(x, g); };
    const auto td0 = Clock::now();
    auto start_point = starting_point(si, image_job ? &prepared : nullptr, encode_fn);
    if (image_job || inpaint_model) timings.vae_encode_ms = ms_since(td0);
    latents = start_point.latents;

    before_strategy = Clock::now();
    job.run_timesteps.assign(sampler->timesteps().begin() + first_step, sampler->timesteps().end());
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
      in.first_step = first_step;
      in.blend_mask = start_point.loop.mask;
      in.blend_image_latents = start_point.loop.image_latents;
      in.blend_noise = start_point.loop.noise;
      in.make_denoiser = [this, &job, strategy](int rank, const c10::Device& d) {
        return rank_denoiser(job, *strategy, rank, d);
      };
      latents = run_strategy_loop(*strategy, *group, std::move(in), latents.to(s.dtype), warm_timestep(job, *sampler),
                                  req, observer, preview_fn, timings, strategy_stats);
    } else {
      const auto model = with_mask_channels(denoiser(job), start_point.mask_channels);
      StepReporter reporter(s.device, req, observer, *sampler, preview_fn, timings, first_step, 0,
                            req.steps - first_step + hires_steps_run(req));
      latents = denoise(*sampler, latents, gen, req.cfg, model, reporter, cancel, nan_hint(), start_point.loop);
    }
    strategy_call_ms = ms_since(before_strategy);
    if (!at::isfinite(latents).all().item<bool>())
      throw Error("the final latents hold NaN or Inf: the model's weights or settings are broken");
    if (cancel.cancelled()) throw job::Cancelled{};
    if (req.hires.enabled()) {
      latents = hires_pass(job, latents, gen, inpaint_model, observer, preview_fn, cancel);
      if (!at::isfinite(latents).all().item<bool>())
        throw Error("the hires pass's latents hold NaN or Inf: the model's weights or settings are broken");
    }

    td = Clock::now();
    auto images = decode(latents, group);
    if (!at::isfinite(images).all().item<bool>())
      throw Error("the VAE decode produced NaN or Inf (an fp16 overflow? the VAE may need fp32)");
    result.images = to_images(images);
    if (image_job) result.images = finish_images(prepared, std::move(result.images), req.input.paste_back);
    timings.vae_decode_ms = ms_since(td);
    stage("vae_decode", timings.vae_decode_ms);
  }
  timings.total_ms = ms_since(start) + timings.load_ms;
  stage("total", timings.total_ms);

  result.a1111_parameters = written_prompt + lora_tags + "\nNegative prompt: " + req.negative_prompt + "\nSteps: " +
                            std::to_string(req.steps) + ", Sampler: " + a1111_sampler(kind) +
                            ", CFG scale: " + format_number(req.cfg) + ", Seed: " + std::to_string(req.seed) +
                            ", Size: " + std::to_string(base_width) + "x" + std::to_string(base_height) +
                            ", Model: " + s.path.filename().string() +
                            (image_job ? ", Denoising strength: " + format_number(strength)
                             : req.hires.enabled() ? ", Denoising strength: " + format_number(req.hires.strength)
                                                   : std::string()) +
                            (req.hires.enabled() ? ", Hires upscale: " + format_number(req.hires.scale) +
                                                       ", Hires steps: " + std::to_string(req.hires.steps) +
                                                       ", Hires upscaler: " +
                                                       (req.hires.upscaler == "latent" ? "Latent (bicubic)" : "Lanczos")
                                                 : std::string()) +
                            (req.input.has_mask() && req.input.mask_blur > 0
                                 ? ", Mask blur: " + std::to_string(req.input.mask_blur) : std::string()) +
                            a1111_extra(job) + lora_hashes(s.loras.applied()) +
                            ", Version: Diffract " + build_info().diffract_version;
  nlohmann::json meta = {
      {"diffract_version", build_info().diffract_version},
      {"model", s.path.string()}, {"family", result.family},
      {"prompt", written_prompt}, {"negative_prompt", req.negative_prompt},
      {"prompt_syntax", req.prompt_syntax == job::PromptSyntax::A1111 ? "a1111" : "plain"},
      {"width", req.width}, {"height", req.height}, {"steps", req.steps}, {"cfg", req.cfg},
      {"seed", req.seed}, {"sampler", req.sampler}, {"device", req.device}, {"batch", req.batch},
      {"taesd", req.taesd}, {"strategy_name", strategy ? strategy->name() : std::string("single")},
      {"devices", strategy ? strategy->devices() : 1},
      {"initial_latents", inputs.initial_latents.defined() ? "given" : "seed"},
      {"timings_ms", timings_json(timings)},
  };
  if (!req.options.empty()) meta["options"] = req.options;
  meta["precision"] = options::value(options::Id::Precision);
  if (!s.loras.applied().empty()) {
    meta["loras"] = nlohmann::json::array();
    for (const auto& a : s.loras.applied()) meta["loras"].push_back(a.json());
  }
  if (loras_changed) meta["loras_apply_ms"] = s.loras.last_apply_ms();  // also when the last set was removed
  if (image_job) meta["input"] = input_json(req.input, prepared, strength, req.steps - first_step, inpaint_model);
  if (!outpaint.is_null()) meta["input"]["outpaint"] = outpaint;
  if (req.hires.enabled())
    meta["hires"] = {{"scale", req.hires.scale}, {"strength", req.hires.strength}, {"upscaler", req.hires.upscaler},
                     {"steps", req.hires.steps}, {"first_pass", std::to_string(base_width) + "x" + std::to_string(base_height)}};
  if (strategy) {
    if (req.strategy.name == strategy->name() && parallel::strategy_info(req.strategy.name).takes(parallel::Param::Skip))
      meta["skip"] = req.strategy.skip;
    if (req.strategy.name == strategy->name() &&
        parallel::strategy_info(req.strategy.name).takes(parallel::Param::CacheThreshold))
      meta["cache_threshold"] = parallel::cache_threshold(req.strategy);
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
  if (latents.defined()) {
    const auto cpu_latents = latents.to(at::kCPU, at::kFloat).contiguous();
    result.latents.assign(cpu_latents.data_ptr<float>(), cpu_latents.data_ptr<float>() + cpu_latents.numel());
    result.latents_shape = cpu_latents.sizes().vec();
  }
  return result;
}

}  // namespace diffract::pipeline
