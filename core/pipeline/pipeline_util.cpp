#include "core/pipeline/pipeline_util.h"

#include <cmath>
#include <cstdlib>
#include <optional>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/nn/module.h>

#include "core/io/upload.h"
#include "core/parallel/device_group.h"
#include "core/parallel/strategies.h"

#include "core/schedulers/sampler.h"
#include "core/text/clip_tokenizer.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/options.h"

namespace diffract::pipeline::detail {

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

at::Device parse_device(const std::string& name) {
  if (name == "cpu") return at::Device(at::kCPU);
  if (name.rfind("cuda", 0) == 0) {
    if (!torch::cuda::is_available()) throw Error("device '" + name + "': no CUDA device is available");
    at::Device d(name == "cuda" ? std::string("cuda:0") : name);
    if (d.index() >= static_cast<int>(torch::cuda::device_count()))
      throw Error("device '" + name + "': only " + std::to_string(torch::cuda::device_count()) + " CUDA device(s)");
    return d;
  }
  throw Error("device '" + name + "' is not 'cpu' or 'cuda:N'");
}

at::Tensor to_bytes(const at::Tensor& x) {
  return ((x.to(at::kFloat) / 2 + 0.5).clamp(0, 1) * 255).round().to(at::kByte).permute({0, 2, 3, 1}).contiguous();
}

std::vector<io::Image> bytes_to_images(const at::Tensor& bytes) {
  const auto u8 = bytes.cpu();
  std::vector<io::Image> out;
  for (int64_t b = 0; b < u8.size(0); ++b) {
    io::Image img;
    img.height = static_cast<int>(u8.size(1));
    img.width = static_cast<int>(u8.size(2));
    const auto* p = u8[b].data_ptr<std::uint8_t>();
    img.rgb.assign(p, p + static_cast<std::size_t>(img.width) * img.height * 3);
    out.push_back(std::move(img));
  }
  return out;
}

std::vector<io::Image> to_images(const at::Tensor& x) { return bytes_to_images(to_bytes(x)); }

std::string format_number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

at::Tensor clip_token_ids(const text::CLIPTokenizer& tok, const std::string& prompt, const at::Device& device,
                          job::StageTimings& timings) {
  const auto t0 = Clock::now();
  auto tokens = tok.tokenize(prompt);
  timings.tokenize_ms += ms_since(t0);
  if (tokens.dropped > 0)
    log::get("pipeline").warn(log::str("prompt is ", tokens.dropped, " tokens over CLIP's ", tok.max_length(),
                                       "-token limit: the end was cut off ('", prompt.substr(0, 40), "...')"));
  return at::tensor(at::ArrayRef<int>(tokens.ids), at::kLong).unsqueeze(0).to(device);
}

void check_tokenizer_fits(const text::CLIPTokenizer& tokenizer, int64_t vocab_size, const std::string& what) {
  if (tokenizer.max_id() >= vocab_size)
    throw Error(what + ": the tokenizer has ids up to " + std::to_string(tokenizer.max_id()) +
                " but its text encoder's vocabulary has " + std::to_string(vocab_size) +
                " entries: the tokenizer and the text encoder do not belong together");
}

void check_request(job::GenerationRequest& req, int native, int multiple, const std::string& why) {
  if (req.width == 0) req.width = native;
  if (req.height == 0) req.height = native;
  const auto size = std::to_string(req.width) + "x" + std::to_string(req.height);
  if (req.width < multiple || req.height < multiple || req.width % multiple || req.height % multiple)
    throw Error("size " + size + " is not a positive multiple of " + std::to_string(multiple) + " (" + why + ")");
  if (req.width > 8192 || req.height > 8192) throw Error("size " + size + " is above 8192 pixels a side");
  if (!(req.cfg >= 0) || !std::isfinite(req.cfg) || req.cfg > 1000)
    throw Error("CFG scale " + format_number(req.cfg) + " must be a number from 0 to 1000");
  if (req.batch < 1 || req.batch > 64) throw Error("batch " + std::to_string(req.batch) + " must be between 1 and 64");
  if (req.preview_every < 0) throw Error("preview interval must be 0 (none) or more");
  if (req.preview_max_side < 0 && req.preview_max_side != job::GenerationRequest::kPreviewAuto)
    throw Error("preview size " + std::to_string(req.preview_max_side) + " must be -1 (auto: half the image, at most 512), "
                "0 (full size) or more pixels");
}

void check_steps(const job::GenerationRequest& req, int train_timesteps) {
  if (req.steps < 1 || req.steps > train_timesteps)
    throw Error("steps " + std::to_string(req.steps) + " must be between 1 and the model's " +
                std::to_string(train_timesteps) + " training timesteps");
}

double warm_up(const std::string& device, const std::string& taesd,
               const std::function<void(const job::GenerationRequest&, const job::JobObserver&)>& run) {
  const auto t0 = Clock::now();
  job::GenerationRequest r;
  r.prompt = "warm-up";
  r.steps = 2;
  r.cfg = 7.0;
  r.device = device;
  r.taesd = taesd;
  r.preview_every = 1;
  job::JobObserver o;
  o.on_preview = [](const job::PreviewEvent&) {};
  run(r, o);
  const double ms = ms_since(t0);
  log::get("pipeline").info(log::str("warm-up in ", static_cast<int>(ms), " ms"));
  return ms;
}

}  // namespace diffract::pipeline::detail

namespace diffract::pipeline::detail {

StepReporter::StepReporter(const c10::Device& device, const job::GenerationRequest& req,
                           const job::JobObserver& observer, const schedulers::Sampler& sampler, Preview preview,
                           job::StageTimings& timings, int first_step, int event_offset, int event_total)
    : req_(req), observer_(observer), sampler_(sampler), preview_(std::move(preview)), timings_(timings),
      first_(first_step), offset_(event_offset),
      total_(event_total > 0 ? event_total : sampler.num_steps() - first_step), clock_(device), previews_(device) {
  clock_.start();
}

void StepReporter::stepped(int i, const at::Tensor& out, const at::Tensor& before) {
  clock_.mark_step();
  const int total = sampler_.num_steps() - first_, k = i - first_;
  if (req_.preview_every > 0 && observer_.on_preview && ((k + 1) % req_.preview_every == 0 || k + 1 == total)) {
    const auto x0 = sampler_.predict_x0(out, i, before).narrow(0, 0, 1);
    if (!previews_.try_start(k + offset_, {x0}, [&] { return to_bytes(preview_(x0)); })) ++timings_.previews_dropped;
  }
  clock_.wait_until_ahead(2);  // the device always has the next step queued, the host stays near
  drain();
}

void StepReporter::finish() {
  clock_.wait_until_ahead(0);
  drain();
  while (auto d = previews_.wait()) deliver(*d);
}

void StepReporter::drain() {
  std::vector<SideStreamTask::Done> previews;  // first: a finished preview implies its step finished
  while (auto d = previews_.poll()) previews.push_back(std::move(*d));
  for (double ms : clock_.finished()) {
    const int i = reported_++;
    const bool cached = cached_.count(i + first_) > 0;
    if (cached) timings_.cached_steps.push_back(static_cast<int>(timings_.step_ms.size()));
    timings_.step_ms.push_back(ms);
    if (observer_.on_step)
      observer_.on_step({i + offset_, total_, sampler_.timesteps()[static_cast<std::size_t>(i + first_)], ms, cached});
  }
  for (const auto& d : previews) deliver(d);
}

void StepReporter::deliver(const SideStreamTask::Done& d) {
  job::PreviewEvent ev;
  ev.index = d.tag;
  ev.image = std::move(bytes_to_images(d.host).front());
  ev.decode_ms = d.device_ms;
  timings_.preview_ms.push_back(d.device_ms);
  observer_.on_preview(ev);
}

at::Tensor denoise(schedulers::Sampler& sampler, at::Tensor latents, at::Generator& gen, double cfg_scale,
                   const std::function<at::Tensor(const at::Tensor& x_in, const at::Tensor& timesteps)>& model,
                   StepReporter& reporter, const job::CancelToken& cancel, const std::string& nan_hint,
                   const LoopImage& image) {
  const bool cfg = cfg_scale > 1.0;
  const int n = sampler.num_steps();
  for (int i = image.first_step; i < n; ++i) {
    if (cancel.cancelled()) throw job::Cancelled{};
    const double t = sampler.timesteps()[static_cast<std::size_t>(i)];
    auto x_in = sampler.scale_model_input(cfg ? at::cat({latents, latents}) : latents, i);
    auto out = model(x_in, at::full({x_in.size(0)}, t, at::TensorOptions().dtype(at::kFloat).device(latents.device())));
    if (cfg) {
      auto parts = out.chunk(2);
      out = parallel::combine_cfg(parts[0], parts[1], cfg_scale);
    }
    const auto before = latents;
    latents = sampler.step(out, i, latents, gen);
    if (image.mask.defined())
      latents = schedulers::blend_outside_mask(sampler, i, latents, image.mask, image.image_latents, image.noise);
    if (latents.is_cpu() && !at::isfinite(latents).all().item<bool>())
      throw Error("the latents hold NaN or Inf after step " + std::to_string(i + 1) +
                  ": the model's weights or settings are broken (" + nan_hint + ")");
    reporter.stepped(i, out, before);
  }
  reporter.finish();
  return latents;
}

StrategyGroups::StrategyGroups() = default;
StrategyGroups::~StrategyGroups() = default;

parallel::DeviceGroup& StrategyGroups::group_for(const c10::Device& model_device, const parallel::Strategy& strategy,
                                                 const std::vector<int>& gpus) {
  const int n = strategy.devices();
  if (model_device.is_cpu()) {
    if (!virtual_ || virtual_->size() != n) virtual_ = parallel::DeviceGroup::virtual_cpu(n);
    return *virtual_;
  }
  const int count = static_cast<int>(torch::cuda::device_count());
  std::vector<int> ids = gpus;
  if (ids.empty())
    for (int r = 0; r < n; ++r) ids.push_back(model_device.index() + r);
  if (static_cast<int>(ids.size()) != n)
    throw Error("strategy " + strategy.name() + " runs on " + std::to_string(n) + " GPUs; the job names " +
                std::to_string(ids.size()));
  if (ids.front() != model_device.index())
    throw Error("strategy " + strategy.name() + ": the job's first GPU must hold the model (cuda:" +
                std::to_string(model_device.index()) + "), not cuda:" + std::to_string(ids.front()));
  for (const int id : ids)
    if (id < 0 || id >= count)
      throw Error("strategy " + strategy.name() + " needs " + std::to_string(n) + " GPUs from cuda:" +
                  std::to_string(model_device.index()) + "; this machine has " + std::to_string(count));
  if (!gpu_ || gpu_ids_ != ids) {
    gpu_.reset();
    gpu_ = parallel::DeviceGroup::cuda(ids);
    gpu_ids_ = ids;
  }
  return *gpu_;
}

void copy_weights(torch::nn::Module& src, torch::nn::Module& dst, const c10::Device& d,
                  const std::function<bool(const std::string&)>& keep) {
  at::NoGradGuard no_grad;
  const auto copy_to = [&](const std::string& name, const at::Tensor& t) {
    if (keep && !keep(name)) return at::empty({0}, t.options().device(d));
    return t.to(at::TensorOptions().device(d), false, /*copy=*/true, at::MemoryFormat::Contiguous);
  };
  auto params = dst.named_parameters(true);
  for (const auto& kv : src.named_parameters(true)) params[kv.key()].set_data(copy_to(kv.key(), kv.value()));
  auto buffers = dst.named_buffers(true);
  for (const auto& kv : src.named_buffers(true)) buffers[kv.key()].set_data(copy_to(kv.key(), kv.value()));
}

void log_replica(const std::string& what, const c10::Device& d, double ms) {
  log::get("pipeline").info(log::str(what, " on ", d.str(), " in ", static_cast<int>(ms), " ms"));
}

at::Tensor run_strategy_loop(const parallel::Strategy& strategy, parallel::DeviceGroup& group, parallel::LoopInputs in,
                             const at::Tensor& warm_input, double warm_timestep, const job::GenerationRequest& req,
                             const job::JobObserver& observer, StepReporter::Preview preview,
                             job::StageTimings& timings, parallel::LoopStats& stats) {
  const auto entered = Clock::now();
  std::string warm_key = strategy.name() + (req.cfg > 1.0 ? " cfg" : "") + " " + c10::toString(warm_input.scalar_type());
  for (const auto d : warm_input.sizes()) warm_key += " " + std::to_string(d);
  // Once per group and shape, not before every job (an evaluation per rank, one after the other).
  const auto t0 = Clock::now();
  if (group.device(0).is_cuda() && group.first_use(warm_key)) {
    // Every rank's CUDA graphs are captured here, one device at a time, before the ranks start:
    // a capture inside the loop (cuDNN autotuning, seconds for SDXL) would run while the other
    // ranks wait in a collective, and ranks that first evaluate at different rounds (DRiffusion's)
    // then hang.
    // Each on its rank's own thread, where cuDNN keeps the plans it makes.
    for (int r = 0; r < group.size(); ++r) {
      group.run_on(r, [&] {
        const auto d = group.device(r);
        strategy.warm_rank(*in.make_denoiser(r, d), at::zeros(warm_input.sizes(), warm_input.options().device(d)),
                           warm_timestep, r);
        torch::cuda::synchronize(d.index());
      });
    }
  }
  const double warm_ms = ms_since(t0);
  const auto sampler = schedulers::Sampler::create(in.kind, in.config, in.steps);  // timesteps, x0 for previews
  // The clock starts before the ranks do (on device 0's current stream, which rank 0's thread
  // shares), so the first step's time holds the ranks' start-up, as the loop's total should.
  StepReporter reporter(group.device(0), req, observer, *sampler, preview, timings, in.first_step);
  in.on_step = [&](int i, const at::Tensor& out, const at::Tensor& before, const at::Tensor&) {
    reporter.stepped(i, out, before);  // on rank 0's thread
  };
  in.on_cached = [&](int i) { reporter.cached(i); };
  for (int r = 0; r < group.size(); ++r) reset_peak_memory(group.device(r));
  const auto t1 = Clock::now();
  auto out = strategy.run(group, in);
  const double loop_ms = ms_since(t1);
  const auto t2 = Clock::now();
  reporter.finish();
  stats = std::move(out.stats);
  stats.warm_ms = warm_ms;
  stats.loop_ms = loop_ms;
  stats.setup_ms = std::chrono::duration<double, std::milli>(t1 - entered).count() - warm_ms;
  if (group.device(0).is_cuda())
    for (int r = 0; r < group.size(); ++r) stats.peak_memory_per_rank.push_back(peak_memory(group.device(r)));
  stats.finish_ms = ms_since(t2);
  return out.latents;
}

std::unique_ptr<io::ScopedPlacement> placement_for(const at::Device& device, at::ScalarType dtype) {
  if (!device.is_cuda() || !options::flag(options::Id::PinnedUpload)) return nullptr;
  return std::make_unique<io::ScopedPlacement>(device, dtype);
}

void log_placement(const io::ScopedPlacement* placement, const std::string& what) {
  if (!placement) return;
  const auto& s = placement->stats();
  const double gb = static_cast<double>(s.bytes) / 1e9;
  log::get("io").info(log::str(what, ": ", s.tensors, " tensors, ", format_number(gb), " GB to the device in ",
                               static_cast<int>(s.ms), " ms (", format_number(s.ms > 0 ? gb / (s.ms / 1000) : 0),
                               " GB/s)"));
}

}  // namespace diffract::pipeline::detail

namespace diffract::pipeline::detail {

void FlowMatchingScheduler::set_file(const std::filesystem::path& scheduler_config_json) {
  json = scheduler_config_json;
  text.clear();
  native = schedulers::native_sampler(json);
}

void FlowMatchingScheduler::set_text(std::string config_text) {
  json.clear();
  text = std::move(config_text);
  native = schedulers::SamplerKind::FlowMatchEuler;
}

schedulers::SamplerKind FlowMatchingScheduler::choose(const std::string& requested, const std::string& family) const {
  schedulers::SamplerKind kind = schedulers::SamplerKind::FlowMatchEuler;
  if (!requested.empty()) kind = schedulers::parse_sampler_or_throw(requested);
  else if (!native || *native != kind)
    log::get("pipeline").info("the model's own scheduler is not flow-euler's; using flow-euler with its settings");
  if (!schedulers::is_flow_matching(kind))
    throw Error(family + " is a flow-matching model: the " + std::string(schedulers::sampler_name(kind)) +
                " sampler does not apply to it (use flow-euler)");
  return kind;
}

schedulers::SchedulerConfig FlowMatchingScheduler::config(schedulers::SamplerKind kind, const std::string& what) const {
  return text.empty() ? schedulers::SchedulerConfig::from_json(json, kind)
                      : schedulers::SchedulerConfig::from_json_text(text, kind, what);
}

}  // namespace diffract::pipeline::detail
