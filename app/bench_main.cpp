// diffract-bench: named benchmark configs on random-weight full-size models (no downloads);
// prints one JSON object per config and batch.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <optional>
#include <regex>

#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/version.h>

#ifdef DIFFRACT_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "core/io/image.h"
#include "core/io/safetensors_writer.h"
#include "core/io/upload.h"
#include "core/io/weights.h"
#include "core/engine/compare.h"
#include "core/metrics/metrics.h"
#include "core/models/common/fp8_linear.h"
#include "core/models/common/layers.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/parallel/registry.h"
#include "core/pipeline/flux.h"
#include "core/pipeline/stable_diffusion.h"
#include "core/pipeline/stable_diffusion_3.h"
#include "core/util/build_info.h"
#include "core/util/device_work.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/options.h"

using namespace diffract;
using nlohmann::json;

namespace {

struct BenchConfig {
  std::string name;
  job::ModelFamily family;
  bool tiny;
  int size;
  int steps;
  double cfg;
  bool schnell = false;  // Flux: schnell's transformer (no guidance embedding)
};

const std::vector<BenchConfig>& configs() {
  static const std::vector<BenchConfig> all = {
      {"sdxl-1024", job::ModelFamily::SDXL, false, 1024, 30, 7.0},
      {"sdxl-768", job::ModelFamily::SDXL, false, 768, 30, 7.0},
      {"sdxl-2048", job::ModelFamily::SDXL, false, 2048, 30, 7.0},  // the patch strategies' large case
      {"sd15-512", job::ModelFamily::SD1, false, 512, 30, 7.0},
      {"sd3-1024", job::ModelFamily::SD3, false, 1024, 28, 7.0},
      {"tiny", job::ModelFamily::SDXL, true, 64, 4, 7.0},  // CI: the same code path in seconds on CPU
      {"tiny-sd3", job::ModelFamily::SD3, true, 64, 4, 7.0},
      // Flux without a negative prompt: the distilled guidance, one evaluation per step.
      {"flux-1024", job::ModelFamily::Flux, false, 1024, 28, 1.0},
      {"flux-schnell-1024", job::ModelFamily::Flux, false, 1024, 4, 1.0, true},
      {"tiny-flux", job::ModelFamily::Flux, true, 64, 4, 1.0},
  };
  return all;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(pos);
  const auto hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

double mean(const std::vector<double>& v) {
  return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

double denoise_ms(const job::GenerationResult& r) {
  return std::accumulate(r.timings.step_ms.begin(), r.timings.step_ms.end(), 0.0);
}

// A strategy spec "name" or "name:n" (n devices; step-skip: its skip factor), then any number
// of "@VAR=VALUE": job-scope runtime options for that strategy's runs alone (A/Bs in one run,
// e.g. driffusion-aggressive:2@DIFFRACT_DRIFFUSION_PAIRS=0). The options table (core/util/
// options.h) says which are job-scope; a process-scope one would change nothing per strategy,
// so it is refused: separate runs A/B those.
struct StrategySpec {
  std::string name;
  int n = 2;
  options::Overrides options;
  std::optional<double> threshold;  // @threshold=X: the step caches' threshold (fbcache)
};

StrategySpec parse_strategy(const std::string& spec) {
  StrategySpec s;
  std::string head = spec.substr(0, spec.find('@'));
  for (auto at = spec.find('@'); at != std::string::npos;) {
    const auto next = spec.find('@', at + 1);
    const auto setting = spec.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1);
    const auto eq = setting.find('=');
    if (eq == std::string::npos || eq == 0)
      throw Error("strategy '" + spec + "': '" + setting + "' is not VAR=VALUE (expected NAME[:N][@VAR=VALUE...])");
    if (setting.substr(0, eq) == "threshold") {
      try {
        s.threshold = std::stod(setting.substr(eq + 1));
      } catch (const std::exception&) {
        throw Error("strategy '" + spec + "': threshold '" + setting.substr(eq + 1) + "' is not a number");
      }
    } else {
      s.options[setting.substr(0, eq)] = setting.substr(eq + 1);
    }
    at = next;
  }
  try {
    options::check_overrides(s.options);
  } catch (const Error& e) {
    throw Error("strategy '" + spec + "': " + e.what());
  }
  const auto colon = head.find(':');
  if (colon == std::string::npos) {
    s.name = head;
    const auto* info = parallel::find_strategy(head);
    s.n = info && (info->devices.fixed == 1 || info->takes(parallel::Param::Skip)) ? 1 : 2;
    return s;
  }
  s.name = head.substr(0, colon);
  try {
    std::size_t used = 0;
    s.n = std::stoi(head.substr(colon + 1), &used);
    if (used != head.size() - colon - 1) throw std::invalid_argument("trailing characters");
  } catch (const std::logic_error&) {
    throw Error("strategy '" + spec + "': expected NAME[:N][@VAR=VALUE...]");
  }
  return s;
}

// A deterministic photo-like init image: smooth colour gradients with a bright disc.
io::Image synthetic_image(int size) {
  io::Image img{size, size, std::vector<std::uint8_t>(static_cast<std::size_t>(size) * size * 3)};
  for (int y = 0; y < size; ++y)
    for (int x = 0; x < size; ++x) {
      const double dx = x - size / 2.0, dy = y - size / 2.0;
      const bool disc = dx * dx + dy * dy < size * size / 16.0;
      auto* p = &img.rgb[(static_cast<std::size_t>(y) * size + x) * 3];
      p[0] = static_cast<std::uint8_t>(disc ? 230 : 255 * x / size);
      p[1] = static_cast<std::uint8_t>(disc ? 200 : 255 * y / size);
      p[2] = static_cast<std::uint8_t>(disc ? 40 : 128);
    }
  return img;
}

// Image-to-image at `strength` and inpainting (the centre quarter of the area, strength 1) of
// the config's job, against its text-to-image denoising time `denoise`.
json image_inputs(pipeline::Pipeline& sd, const job::GenerationRequest& req, int runs, double strength, double denoise) {
  const auto clock = [] { return std::chrono::steady_clock::now(); };
  const auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  job::CancelToken never;
  const auto timed = [&](const job::GenerationRequest& r) {
    sd.generate(r, {}, never);  // first use of the encoder's shapes
    std::vector<double> e2e, den, enc;
    job::GenerationResult last;
    for (int i = 0; i < runs; ++i) {
      const auto t = clock();
      last = sd.generate(r, {}, never);
      e2e.push_back(ms(t, clock()));
      den.push_back(denoise_ms(last));
      enc.push_back(last.timings.vae_encode_ms);
    }
    return json{{"end_to_end_ms", percentile(e2e, 0.5)}, {"denoising_ms", percentile(den, 0.5)},
                {"steps_run", last.timings.step_ms.size()}, {"vae_encode_enqueue_ms", percentile(enc, 0.5)},
                {"step_ms", mean(last.timings.step_ms)}};
  };
  auto i2i = req;
  i2i.input.image = synthetic_image(req.width);
  i2i.input.strength = strength;
  json out;
  out["img2img"] = timed(i2i);
  out["img2img"]["strength"] = strength;
  auto inpaint = i2i;
  inpaint.input.strength = 1.0;
  inpaint.input.mask = io::Image{req.width, req.height, std::vector<std::uint8_t>(inpaint.input.image.rgb.size(), 0)};
  for (int y = req.height / 4; y < 3 * req.height / 4; ++y)
    std::fill_n(&inpaint.input.mask.rgb[(static_cast<std::size_t>(y) * req.width + req.width / 4) * 3],
                static_cast<std::size_t>(req.width / 2) * 3, std::uint8_t(255));
  out["inpaint"] = timed(inpaint);
  out["inpaint"]["added_to_denoising_pct"] =
      denoise > 0 ? 100.0 * (out["inpaint"]["denoising_ms"].get<double>() - denoise) / denoise : 0.0;
  return out;
}

// One ControlNet (random weights, this model's encoder) on the config's job against the same job
// without: the denoiser step (ControlNet + UNet) and end to end.
json controlnet_step(pipeline::StableDiffusion& sd, const job::GenerationRequest& req, int runs, double plain_step_ms,
                     const std::string& scratch) {
  const auto dir = std::filesystem::path(scratch) / "bench-controlnet";
  sd.write_random_controlnet(dir, 11);
  auto r = req;
  job::ControlNetRef c;
  c.path = dir.string();
  c.image = synthetic_image(req.width);
  r.controlnets = {c};
  job::CancelToken never;
  sd.generate(r, {}, never);  // loads it, captures the graphs of the new shape
  std::vector<double> e2e, step;
  const auto clock = [] { return std::chrono::steady_clock::now(); };
  for (int i = 0; i < runs; ++i) {
    const auto t = clock();
    const auto res = sd.generate(r, {}, never);
    e2e.push_back(std::chrono::duration<double, std::milli>(clock() - t).count());
    step.push_back(mean(res.timings.step_ms));
  }
  // File by file: the PyTorch wheel's libtorch.so exports a std::filesystem::remove_all of its own
  // libstdc++, which interposes on ours and jumps to address 0 (seen on the GPU machine).
  for (const char* f : {"config.json", "diffusion_pytorch_model.safetensors"}) std::filesystem::remove(dir / f);
  std::filesystem::remove(dir);
  const double s = percentile(step, 0.5);
  return {{"step_ms", s}, {"plain_step_ms", plain_step_ms}, {"step_ratio", plain_step_ms > 0 ? s / plain_step_ms : 0.0},
          {"end_to_end_ms", percentile(e2e, 0.5)}};
}

// A random rank-`rank` LoRA over every attention, feed-forward and projection layer of the
// denoiser and the text encoders (diffusers' layout, bf16), written to `scratch`; then its
// application to the loaded model, a switch to another weight, and its removal, each measured
// by the pipeline (loras_apply_ms) on a 2-step job.
json lora_apply(pipeline::Pipeline& sd, const job::GenerationRequest& req, int rank, const std::string& scratch) {
  static const std::regex target(
      R"((^|\.)(to_q|to_k|to_v|to_out\.0|ff\.net\.0\.proj|ff\.net\.2|proj_in|proj_out|q_proj|k_proj|v_proj|out_proj|fc1|fc2|add_q_proj|add_k_proj|add_v_proj|to_add_out|ff_context\.net\.0\.proj|ff_context\.net\.2)$)");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  at::Generator gen = at::detail::createCPUGenerator(7);
  std::map<std::string, int> layers;
  int64_t params = 0;
  for (const auto& [component, modules] : sd.lora_modules().components)
    for (const auto& [name, shape] : modules) {
      if (!std::regex_search(name, target) || shape.size() != 2) continue;
      const auto opts = at::TensorOptions().dtype(at::kFloat);
      tensors.emplace_back(component + "." + name + ".lora_A.weight",
                           (at::randn({rank, shape[1]}, gen, opts) * 0.01).to(at::kBFloat16));
      tensors.emplace_back(component + "." + name + ".lora_B.weight",
                           (at::randn({shape[0], rank}, gen, opts) * 0.01).to(at::kBFloat16));
      tensors.emplace_back(component + "." + name + ".alpha", at::full({}, static_cast<double>(rank), opts));
      params += rank * (shape[0] + shape[1]);
      layers[component]++;
    }
  std::filesystem::create_directories(scratch);
  const auto file = std::filesystem::path(scratch) / ("bench-lora-r" + std::to_string(rank) + ".safetensors");
  io::write_safetensors(file, tensors);
  tensors.clear();
  auto r = req;
  r.steps = 2;
  r.loras = {{file.string(), 1.0, 1.0, ""}};
  job::CancelToken never;
  const auto apply_ms = [&] { return json::parse(sd.generate(r, {}, never).metadata_json).value("loras_apply_ms", -1.0); };
  json out = {{"rank", rank}, {"layers", layers}, {"params", params},
              {"file_mb", static_cast<double>(std::filesystem::file_size(file)) / (1 << 20)}};
  out["apply_ms"] = apply_ms();
  r.loras[0].weight = r.loras[0].text_encoder_weight = 0.5;
  out["switch_ms"] = apply_ms();  // the originals back, then the new weight
  r.loras.clear();
  out["remove_ms"] = apply_ms();
  std::filesystem::remove(file);
  return out;
}

// A config's pipeline on random weights; unet / flux point into it for the family-only reports.
struct RandomPipeline {
  std::unique_ptr<pipeline::Pipeline> sd;
  pipeline::StableDiffusion* unet = nullptr;  // the UNet profile is SD / SDXL only
  pipeline::Flux* flux = nullptr;
  pipeline::StableDiffusion3* sd3 = nullptr;
};

RandomPipeline random_pipeline(const BenchConfig& c, const std::string& device) {
  RandomPipeline p;
  if (c.family == job::ModelFamily::SD3) {
    auto m = pipeline::StableDiffusion3::random(c.tiny, device);
    p.sd3 = m.get();
    p.sd = std::move(m);
  } else if (c.family == job::ModelFamily::Flux) {
    auto m = pipeline::Flux::random(c.tiny, c.schnell, device);
    p.flux = m.get();
    p.sd = std::move(m);
  } else {
    auto m = pipeline::StableDiffusion::random(c.family, c.tiny, device);
    p.unet = m.get();
    p.sd = std::move(m);
  }
  return p;
}

// The request every mode times: the config's size, steps and CFG, no previews.
job::GenerationRequest bench_request(const BenchConfig& c, int batch, const std::string& device) {
  job::GenerationRequest req;
  req.model = "<random>";
  req.prompt = "a studio packshot of a red perfume bottle on a white background, soft shadow";
  req.width = req.height = c.size;
  req.steps = c.steps;
  req.cfg = c.cfg;
  req.batch = batch;
  req.device = device;
  req.sampler = job::has_unet(c.family) ? "euler" : "flow-euler";
  req.preview_every = 0;
  return req;
}

// What the timed choices (GEMM algorithms, convolution plans, fp8) did between two
// models::tuning_stats() readings: per kind, shapes timed, shapes from the tuning store, ms.
json tuning_delta(const json& before, const json& after) {
  json d = json::object();
  for (const auto& [kind, a] : after.items()) {
    if (kind == "stores") continue;
    const json b = before.contains(kind) ? before[kind] : json{{"timed", 0}, {"from_store", 0}, {"ms", 0.0}};
    d[kind] = {{"timed", a["timed"].get<int>() - b["timed"].get<int>()},
               {"from_store", a["from_store"].get<int>() - b["from_store"].get<int>()},
               {"ms", a["ms"].get<double>() - b["ms"].get<double>()}};
  }
  return d;
}

// --new-sizes: what a size not used before costs. The model's warm-up (its native size), then for
// each size the first job there, timed, and `runs` more: the first image's added time, what the
// timed choices spent (or took from the tuning store) and the UNet's graph capture.
json new_sizes(const BenchConfig& c, const std::string& device, const std::vector<std::string>& sizes, int runs) {
  static const std::regex size_re("([0-9]{2,5})x([0-9]{2,5})");
  auto p = random_pipeline(c, device);
  job::CancelToken never;
  const auto clock = [] { return std::chrono::steady_clock::now(); };
  const auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  auto stats = json::parse(models::tuning_stats());
  const double warm_up_ms = p.sd->warm_up();
  auto after = json::parse(models::tuning_stats());
  json j = {{"config", c.name}, {"device", device}, {"mode", "new-sizes"}, {"steps", c.steps},
            {"warm_up_ms", warm_up_ms}, {"warm_up_tuning", tuning_delta(stats, after)}, {"sizes", json::array()}};
  stats = after;
  for (const auto& size : sizes) {
    std::smatch m;
    if (!std::regex_match(size, m, size_re)) throw Error("--new-sizes: '" + size + "' is not WIDTHxHEIGHT");
    auto req = bench_request(c, 1, device);
    req.width = std::stoi(m[1]);
    req.height = std::stoi(m[2]);
    const auto t0 = clock();
    const auto first = p.sd->generate(req, {}, never);
    const double first_ms = ms(t0, clock());
    after = json::parse(models::tuning_stats());
    const auto tuning = tuning_delta(stats, after);
    stats = after;
    std::vector<double> later;
    bool repeatable = true;  // the first job (eager warm-ups, then the capture) ends where the replays do
    for (int r = 0; r < runs; ++r) {
      const auto t = clock();
      const auto res = p.sd->generate(req, {}, never);
      later.push_back(ms(t, clock()));
      repeatable = repeatable && res.latents == first.latents;
    }
    json row = {{"size", size},         {"first_image_ms", first_ms}, {"later_ms", percentile(later, 0.5)},
                {"added_ms", first_ms - percentile(later, 0.5)}, {"tuning", tuning}, {"repeatable", repeatable}};
    const auto meta = json::parse(first.metadata_json);
    if (meta.contains("unet_graphs")) row["unet_graphs"] = meta["unet_graphs"];
    j["sizes"].push_back(row);
    log::get("bench").info(row.dump());
  }
  j["tuning_stats"] = json::parse(models::tuning_stats());
  j["conv_plans"] = json::parse(models::conv_tuning_report());
  return j;
}

json run_config(const BenchConfig& c, int batch, int runs, const std::string& device,
                const std::vector<std::string>& strategies, double image_strength, int lora_rank,
                const std::string& scratch, bool controlnet) {
  const bool cuda = device.rfind("cuda", 0) == 0;
#ifdef DIFFRACT_HAS_CUDA
  const auto index = static_cast<c10::DeviceIndex>(cuda ? at::Device(device == "cuda" ? "cuda:0" : device).index() : 0);
  if (cuda) {
    at::empty({1}, at::TensorOptions().device(at::kCUDA, index));  // initialises the caching allocator
    reset_peak_memory(at::Device(at::kCUDA, index));
  }
#endif
  auto made = random_pipeline(c, device);
  auto& sd = made.sd;
  pipeline::StableDiffusion* unet_pipeline = made.unet;
  pipeline::Flux* flux_pipeline = made.flux;
  pipeline::StableDiffusion3* sd3_pipeline = made.sd3;
  const double warm_up_ms = sd->warm_up();  // what the engine does at load (GPU only)
  auto req = bench_request(c, batch, device);
  job::CancelToken never;
  const auto clock = [] { return std::chrono::steady_clock::now(); };
  const auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };

  // What the GUI does when the user sets a size or batch other than the warm-up's.
  const double prepare_ms = sd->prepare(req);
  const auto t0 = clock();
  auto first = sd->generate(req, {}, never);  // every first-use cost (cuDNN plans, allocator growth)
  const double first_ms = ms(t0, clock());  // the model build and warm-up happened before t0
  std::vector<double> e2e, steps, text, vae;
  job::GenerationResult last;
  // Whether every later run of the same request (previews on or off) ends in the first run's
  // latents, bit for bit: what a user re-running a seed expects.
  bool repeatable = true;
  for (int r = 0; r < runs; ++r) {
    const auto t = clock();
    auto res = sd->generate(req, {}, never);
    e2e.push_back(ms(t, clock()));
    repeatable = repeatable && res.latents == first.latents;
    last = res;
    steps.insert(steps.end(), res.timings.step_ms.begin(), res.timings.step_ms.end());
    text.push_back(res.timings.text_encode_ms);
    vae.push_back(res.timings.vae_decode_ms);
  }
  // The same job with a TAESD preview of every step.
  auto with_previews = req;
  with_previews.taesd = "<random>";
  with_previews.preview_every = 1;
  job::JobObserver o;
  o.on_preview = [](const job::PreviewEvent&) {};
  std::vector<double> e2e_p, denoise_p, previews;
  int dropped = 0;
  for (int r = 0; r < runs; ++r) {
    const auto t = clock();
    auto res = sd->generate(with_previews, o, never);
    e2e_p.push_back(ms(t, clock()));
    repeatable = repeatable && res.latents == first.latents;
    denoise_p.push_back(denoise_ms(res));
    previews.insert(previews.end(), res.timings.preview_ms.begin(), res.timings.preview_ms.end());
    dropped += res.timings.previews_dropped;
  }
  // Previews decode on their own stream: what they cost is what the denoising loop lost.
  const double denoise = mean(steps) * c.steps;
  // Previews at half the image's side (a quarter of the decode), where the default leaves them
  // larger: what a smaller preview would cost instead.
  json half_side;
  if (c.size / 2 < with_previews.preview_side()) {
    auto half = with_previews;
    half.preview_max_side = c.size / 2;
    sd->prepare(half);
    std::vector<double> denoise_h, previews_h;
    for (int r = 0; r < runs; ++r) {
      auto res = sd->generate(half, o, never);
      denoise_h.push_back(denoise_ms(res));
      previews_h.insert(previews_h.end(), res.timings.preview_ms.begin(), res.timings.preview_ms.end());
    }
    half_side = {{"preview_side", half.preview_max_side},
                 {"preview_decode_ms", mean(previews_h)},
                 {"preview_added_to_denoising_pct",
                  denoise > 0 ? 100.0 * (percentile(denoise_h, 0.5) - denoise) / denoise : 0.0}};
  }
  json j = {
      {"config", c.name}, {"batch", batch}, {"device", device}, {"width", c.size}, {"height", c.size},
      {"steps", c.steps}, {"cfg", c.cfg}, {"runs", runs},
      {"dtype", cuda ? "bf16" : "fp32"},
      {"model_build_ms", first.timings.load_ms},
      {"first_image_ms", first_ms},
      {"end_to_end_ms", {{"median", percentile(e2e, 0.5)}, {"min", *std::min_element(e2e.begin(), e2e.end())}}},
      {"images_per_s", 1e3 * batch / percentile(e2e, 0.5)},
      {"first_vs_later", first_ms / percentile(e2e, 0.5)},
      {"text_encode_ms", percentile(text, 0.5)},
      {"denoiser_step_ms", {{"mean", mean(steps)}, {"p50", percentile(steps, 0.5)}, {"p95", percentile(steps, 0.95)}}},
      {"vae_decode_ms", percentile(vae, 0.5)},
      {"preview_decode_ms", mean(previews)},
      {"preview_side", with_previews.preview_side()},
      {"previews_shown", previews.size() / static_cast<std::size_t>(runs)},
      {"previews_dropped_per_run", static_cast<double>(dropped) / runs},
      {"end_to_end_with_previews_ms", percentile(e2e_p, 0.5)},
      {"denoising_with_previews_ms", percentile(denoise_p, 0.5)},
      {"preview_added_to_denoising_pct", denoise > 0 ? 100.0 * (percentile(denoise_p, 0.5) - denoise) / denoise : 0.0},
      {"warm_up_ms", warm_up_ms},
      {"prepare_ms", prepare_ms},
      {"repeatable", repeatable},
  };
  if (!half_side.is_null()) j["previews_half_side"] = half_side;
  if (image_strength >= 0) j["image_inputs"] = image_inputs(*sd, req, runs, image_strength, denoise);
  if (lora_rank > 0) j["lora"] = lora_apply(*sd, req, lora_rank, scratch);
  if (controlnet && unet_pipeline)
    j["controlnet"] = controlnet_step(*unet_pipeline, req, runs, j["denoiser_step_ms"]["mean"].get<double>(), scratch);
  {
    const auto meta = json::parse(last.metadata_json);
    if (meta.contains("unet_graphs")) j["unet_graphs"] = meta["unet_graphs"];
  }
  if (cuda && unet_pipeline) {
    j["unet_step_variants"] = json::parse(unet_pipeline->profile_unet_step(c.size, 2 * batch, 10));
    // What one branch costs alone: the floor under CFG-parallel's step.
    if (!strategies.empty())
      j["unet_step_variants_one_branch"] = json::parse(unet_pipeline->profile_unet_step(c.size, batch, 10));
  }
#ifdef DIFFRACT_HAS_CUDA
  if (cuda) {
    // Before the strategies, whose loops reset the peak to report their own per GPU.
    j["peak_vram_gib"] = static_cast<double>(peak_memory(at::Device(at::kCUDA, index))) / (1ull << 30);
    j["gpu"] = at::cuda::getDeviceProperties(index)->name;
  }
#endif
  if (cuda && flux_pipeline) j["transformer_step_profile"] = json::parse(flux_pipeline->profile_transformer_step(c.size, 5));
  if (cuda && sd3_pipeline) j["transformer_step_profile"] = json::parse(sd3_pipeline->profile_transformer_step(c.size, 5));
  // Strategies: the same job run by each, against the single-device result of this run.
  const double base_e2e = percentile(e2e, 0.5), base_denoise = denoise;
  for (const auto& spec : strategies) {
    const auto sp = parse_strategy(spec);
    const auto& name = sp.name;
    const int n = sp.n;
    auto sreq = req;
    sreq.strategy.name = name;
    if (parallel::strategy_info(name).takes(parallel::Param::Skip)) sreq.strategy.skip = n;
    else sreq.strategy.devices = n;
    sreq.options = sp.options;
    if (sp.threshold) sreq.strategy.cache_threshold = *sp.threshold;
    sd->generate(sreq, {}, never);  // replicas, communicators, graphs on the other devices
    std::vector<double> se2e, sden;
    job::GenerationResult sres;
    bool srepeatable = true;
    for (int r = 0; r < runs; ++r) {
      const auto t = clock();
      auto res = sd->generate(sreq, {}, never);
      se2e.push_back(ms(t, clock()));
      sden.push_back(denoise_ms(res));
      srepeatable = srepeatable && (r == 0 || res.latents == sres.latents);
      sres = std::move(res);
    }
    const auto meta = json::parse(sres.metadata_json);
    json sj = {{"strategy", name}, {"n", n}, {"spec", spec},
               {"end_to_end_ms", percentile(se2e, 0.5)},
               {"denoising_ms", percentile(sden, 0.5)},
               {"images_per_s", 1e3 * batch / percentile(se2e, 0.5)},
               {"speedup_end_to_end", base_e2e / percentile(se2e, 0.5)},
               {"speedup_denoising", base_denoise / percentile(sden, 0.5)},
               {"psnr_db", metrics::psnr(sres.images.front(), last.images.front())},
               {"ssim", metrics::ssim(sres.images.front(), last.images.front())},
               {"latents_rel_l2", engine::latents_rel_l2(sres, last)},
               {"repeatable", srepeatable}};
    if (meta.contains("strategy")) sj["stats"] = meta["strategy"];
    sj["step_ms"] = sres.timings.step_ms;
    sj["text_encode_ms"] = sres.timings.text_encode_ms;
    sj["vae_decode_ms"] = sres.timings.vae_decode_ms;
    j["strategies"].push_back(sj);
    log::get("bench").info(sj.dump());
  }
  // What fp8 timed per GEMM shape (single@DIFFRACT_PRECISION=fp8 and the like).
  if (const auto fp8 = json::parse(models::fp8_tuning_report()); !fp8.empty()) {
    j["fp8_gemms"] = fp8;
    // How the fp8 GEMMs' inputs were quantised, per call traced (graph replays count nothing).
    const auto rows = models::fp8_rows_counts();
    j["fp8_rows"] = {{"offered", rows.offered}, {"taken", rows.taken}, {"quantised", rows.quantised}};
  }
  return j;
}

// The full-size UNet of an sdxl or sd15 config, for the modes that time the UNet alone.
models::UNet2DConditionConfig full_size_unet(const BenchConfig& c, const std::string& mode) {
  if (c.tiny || !job::has_unet(c.family)) throw Error(mode + " times the full-size UNets: pick an sdxl or sd15 config");
  return c.family == job::ModelFamily::SDXL ? models::UNet2DConditionConfig::sdxl_base()
                                            : models::UNet2DConditionConfig::sd15();
}

// Only the UNet's construction on the CPU (what every model load and replica pays before the
// weights are bound), then the explicit random init that random-weight models add on top.
json build_only(const BenchConfig& c) {
  const auto config = full_size_unet(c, "--build-only");
  const auto clock = [] { return std::chrono::steady_clock::now(); };
  const auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  const auto t0 = clock();
  models::UNet2DConditionModel unet(config);
  const auto t1 = clock();
  models::init_random(*unet, 0);
  const auto t2 = clock();
  int64_t n = 0;
  for (const auto& p : unet->parameters()) n += p.numel();
  return {{"config", c.name}, {"device", "cpu"}, {"unet_parameters", n}, {"unet_build_ms", ms(t0, t1)},
          {"unet_init_random_ms", ms(t1, t2)}};
}

// The file's pages out of the page cache, so the next read comes from the disk.
bool drop_from_page_cache(const std::filesystem::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY);
  if (fd < 0) return false;
  const bool ok = ::fsync(fd) == 0 && ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0;
  ::close(fd);
  return ok;
}

// Loading the config's UNet from one safetensors file of fp16 weights (as downloads ship them)
// onto `device` in the pipeline's dtype, two ways in turns: bound into CPU tensors and the
// module moved afterwards (DIFFRACT_PINNED_UPLOAD=0), and through pinned chunks straight onto the
// device (io::ScopedPlacement, what the pipelines do on GPUs); each from the page cache and with
// the file's pages dropped from it first.
json load_only(const BenchConfig& c, const std::string& device, const std::filesystem::path& scratch, int runs) {
  const auto config = full_size_unet(c, "--load-only");
  const at::Device dev(device);
  const auto dtype = dev.is_cuda() ? at::kBFloat16 : at::kFloat;
  const auto file = scratch / (c.name + "-unet.fp16.safetensors");
  std::filesystem::create_directories(scratch);
  std::int64_t bytes = 0;
  {
    models::UNet2DConditionModel unet(config);
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& p : unet->named_parameters()) {
      tensors.emplace_back(p.key(), at::zeros(p.value().sizes(), at::kHalf));
      bytes += static_cast<std::int64_t>(tensors.back().second.nbytes());
    }
    io::write_safetensors(file, tensors);
  }
  const auto clock = [] { return std::chrono::steady_clock::now(); };
  const auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  const auto sync = [&] {
    if (dev.is_cuda()) torch::cuda::synchronize(dev.index());
  };
  const auto load = [&](bool pinned) {
    const auto t0 = clock();
    std::unique_ptr<io::ScopedPlacement> placement;
    if (pinned) placement = std::make_unique<io::ScopedPlacement>(dev, dtype);
    models::UNet2DConditionModel unet(config);
    io::bind(*unet, io::load_state_dict(file), file.string());
    unet->to(dev, dtype);
    sync();
    return ms(t0, clock());
  };
  json out = {{"config", c.name}, {"device", device}, {"file_bytes", bytes}, {"file", file.string()}};
  for (const bool cold : {false, true}) {
    std::vector<double> plain, pinned;
    bool dropped = true;
    load(true);  // the allocator's first growth, off the clock
    for (int r = 0; r < runs; ++r)
      for (const bool p : {false, true}) {
        if (cold) dropped = drop_from_page_cache(file) && dropped;
        (p ? pinned : plain).push_back(load(p));
      }
    const auto gbs = [&](double t) { return static_cast<double>(bytes) / 1e9 / (t / 1000); };
    out[cold ? "cold" : "page_cache"] = {
        {"bind_then_move_ms", percentile(plain, 0.5)}, {"pinned_upload_ms", percentile(pinned, 0.5)},
        {"bind_then_move_gb_s", gbs(percentile(plain, 0.5))}, {"pinned_upload_gb_s", gbs(percentile(pinned, 0.5))},
        {"speed_up", percentile(plain, 0.5) / percentile(pinned, 0.5)}};
    if (cold) out["cold"]["pages_dropped"] = dropped;
  }
  std::filesystem::remove(file);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"diffract-bench: Diffract's pipeline on random-weight models, as JSON"};
  std::vector<std::string> names = {"tiny"};
  std::vector<int> batches = {1};
  std::string device = "cpu";
  int runs = 3;
  bool verbose = false, build = false, load = false;
  std::string scratch = (std::filesystem::temp_directory_path() / "diffract-bench").string();
  std::vector<std::string> strategies;
  double image_strength = -1;
  int lora_rank = 0;
  bool controlnet = false;
  std::string names_help = "configs:";
  for (const auto& c : configs()) names_help += " " + c.name;
  app.add_option("--config", names, names_help)->delimiter(',');
  app.add_option("--batch", batches, "images per prompt, e.g. 1,4")->delimiter(',');
  app.add_option("--device", device, "cpu or cuda:N")->capture_default_str();
  app.add_option("--runs", runs, "timed runs after the warm-up")->capture_default_str();
  app.add_option("--strategies", strategies,
                 "also run each strategy (NAME[:N][@VAR=VALUE...], e.g. cfg-parallel,driffusion-aggressive:2, "
                 "driffusion-aggressive:2@DIFFRACT_DRIFFUSION_PAIRS=0, with the job-scope options diffract-cli info lists, "
                 "fbcache@threshold=0.3 for a step cache's threshold) "
                 "and compare it with the single-device result: "
                 "speed-up, PSNR, SSIM, latent rel-L2")
      ->delimiter(',');
  app.add_flag("--build-only", build, "only time building each config's UNet on the CPU, and its random init");
  app.add_flag("--load-only", load,
               "only time loading each config's UNet from an fp16 safetensors file (written to --scratch first) onto "
               "--device: bound then moved, against pinned chunks straight to the device; page cache and cold");
  app.add_option("--scratch", scratch, "folder for --load-only's file")->capture_default_str();
  app.add_option("--image-inputs", image_strength,
                 "also time image-to-image at this strength and inpainting (a centred mask, strength 1) of each "
                 "config's job, against its text-to-image denoising")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--lora-rank", lora_rank,
                 "also time applying, switching and removing a random LoRA of this rank (every attention, "
                 "feed-forward and projection layer of the denoiser and text encoders; written to --scratch)")
      ->check(CLI::Range(1, 1024));
  app.add_flag("--controlnet", controlnet,
               "also time the job with one ControlNet (random weights, the UNet's encoder; SD-family configs) against "
               "its step without");
  std::vector<std::string> sizes;
  app.add_option("--new-sizes", sizes,
                 "only time the first job at each of these sizes (WIDTHxHEIGHT, e.g. 1152x896,768x768) after the "
                 "model's warm-up, against later jobs there: what tuning and graph capture add, and what the tuning "
                 "store (DIFFRACT_TUNING_DIR) saved")
      ->delimiter(',');
  app.add_flag("-v,--verbose", verbose);
  CLI11_PARSE(app, argc, argv);
  log::set_verbose(verbose);
  try {
    if (runs < 1) throw Error("--runs must be at least 1");
    for (const auto& spec : strategies) parse_strategy(spec);  // a typo fails now, not after the one-device runs
    const auto info = build_info();
    json out = {{"diffract", info.diffract_version}, {"torch", TORCH_VERSION}, {"cuda_devices", info.cuda_devices},
                {"nccl", info.nccl_version}, {"results", json::array()}};
    for (const auto& name : names) {
      auto it = std::find_if(configs().begin(), configs().end(), [&](const BenchConfig& c) { return c.name == name; });
      if (it == configs().end()) throw Error("unknown config '" + name + "' (" + names_help + ")");
      if (build) {
        out["results"].push_back(build_only(*it));
        continue;
      }
      if (!sizes.empty()) {
        out["results"].push_back(new_sizes(*it, device, sizes, runs));
        continue;
      }
      if (load) {
        out["results"].push_back(load_only(*it, device, scratch, runs));
        log::get("bench").info(out["results"].back().dump());
        continue;
      }
      for (int b : batches) {
        if (b < 1) throw Error("--batch values must be at least 1");
        out["results"].push_back(run_config(*it, b, runs, device, strategies, image_strength, lora_rank, scratch, controlnet));
        log::get("bench").info(out["results"].back().dump());
      }
    }
    std::cout << out.dump(1) << "\n";
  } catch (const std::exception& e) {
    log::get("bench").error(e.what());
    return 1;
  }
  return 0;
}
