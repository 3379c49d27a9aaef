#include "core/engine/compare.h"

#include <ATen/ATen.h>

#include "core/metrics/metrics.h"
#include "core/util/error.h"

namespace diffract::engine {

namespace {

double generation_ms(const job::GenerationResult& r) { return r.timings.total_ms - r.timings.load_ms; }

at::Tensor latents_of(const job::GenerationResult& r) {
  return at::from_blob(const_cast<float*>(r.latents.data()), r.latents_shape, at::kFloat);
}

}  // namespace

double latents_rel_l2(const job::GenerationResult& a, const job::GenerationResult& b) {
  return metrics::relative_l2(latents_of(a), latents_of(b));
}

job::GenerationRequest warm_up_job(const job::GenerationRequest& request, bool with_strategy) {
  auto w = request;
  if (!with_strategy) {
    w.strategy = {};
    w.gpus.clear();
  }
  w.steps = std::min(request.steps, with_strategy ? 2 : 1);
  w.preview_every = 0;
  w.hires = {};
  return w;
}

Measures measure(const job::GenerationResult& other, const job::GenerationResult& baseline) {
  if (other.images.empty() || baseline.images.empty()) throw Error("compare: a job without images");
  const auto& a = other.images.front();
  const auto& b = baseline.images.front();
  if (a.width != b.width || a.height != b.height)
    throw Error("compare: images of " + std::to_string(a.width) + "x" + std::to_string(a.height) + " and " +
                std::to_string(b.width) + "x" + std::to_string(b.height) + " pixels");
  Measures m;
  m.speedup = generation_ms(baseline) / std::max(generation_ms(other), 1e-9);
  m.psnr = metrics::psnr(a, b);
  m.ssim = metrics::ssim(a, b);
  if (!baseline.latents.empty() && other.latents_shape == baseline.latents_shape) m.latents_rel_l2 = latents_rel_l2(other, baseline);
  auto diff = metrics::abs_diff_map(a, b);
  const double peak = std::max(diff.max().item<double>(), 1e-12);
  // Black (equal) through red and yellow to white (the largest difference).
  auto t = (diff / peak).clamp(0, 1);
  auto rgb = at::stack({(t * 3).clamp(0, 1), (t * 3 - 1).clamp(0, 1), (t * 3 - 2).clamp(0, 1)}, -1);
  auto u8 = (rgb * 255).round().to(at::kByte).contiguous();
  m.heatmap.width = static_cast<int>(u8.size(1));
  m.heatmap.height = static_cast<int>(u8.size(0));
  m.heatmap.rgb.assign(u8.data_ptr<std::uint8_t>(), u8.data_ptr<std::uint8_t>() + u8.numel());
  return m;
}

Comparison compare(Engine& engine, job::GenerationRequest request, const job::StrategyParams& strategy,
                   const job::JobObserver& observer, const job::CancelToken& cancel) {
  if (strategy.single() && request.precision != "fp8")
    throw Error("compare needs a strategy other than 'single', or precision fp8");
  Comparison c;
  // The baseline: the plain loop in the model's dtype.
  auto baseline = request;
  baseline.strategy = {};
  baseline.gpus.clear();
  baseline.precision.clear();
  // Short runs first load the model and pay every first-use cost outside the timings: the plain
  // loop's and the strategy's (its replicas, its ranks' graphs and plans).
  engine.run(warm_up_job(baseline, false), {}, cancel);
  request.strategy = strategy;
  try {
    engine.run(warm_up_job(request, true), {}, cancel);
  } catch (const Error&) {
    // A strategy that cannot run two steps says so in the timed run below.
  }
  c.baseline = engine.run(baseline, observer, cancel);
  c.accelerated = engine.run(request, observer, cancel);
  static_cast<Measures&>(c) = measure(c.accelerated, c.baseline);
  return c;
}

}  // namespace diffract::engine
