#pragma once
#include <string>

#include "core/engine/engine.h"

namespace diffract::engine {

// A strategy against the plain single-device loop, same request and seed.
struct Comparison {
  job::GenerationResult baseline;
  job::GenerationResult accelerated;
  double speedup = 0;          // baseline / accelerated time, text encode to decoded image (model load excluded)
  double psnr = 0;             // first images, dB (infinite when identical)
  double ssim = 0;
  double latents_rel_l2 = 0;   // ||a - b|| / ||b|| of the final latents, b the baseline
  io::Image heatmap;           // |difference| per pixel, scaled so the largest is white
};

// metrics::relative_l2 of two jobs' final latents, `b` the baseline.
double latents_rel_l2(const job::GenerationResult& a, const job::GenerationResult& b);

// Runs a one-step warm-up, then `request` with strategy "single" and with `strategy`.
Comparison compare(Engine& engine, job::GenerationRequest request, const job::StrategyParams& strategy,
                   const job::JobObserver& observer, const job::CancelToken& cancel);

}  // namespace diffract::engine
