#pragma once
#include <string>

#include "core/engine/engine.h"

namespace diffract::engine {

// A strategy against the plain single-device loop, same request and seed.
struct Comparison {
  GenerationResult baseline;
  GenerationResult accelerated;
  double speedup = 0;          // baseline / accelerated time, text encode to decoded image (model load excluded)
  double psnr = 0;             // first images, dB (infinite when identical)
  double ssim = 0;
  double latents_rel_l2 = 0;   // ||a - b|| / ||b|| of the final latents, b the baseline
  io::Image heatmap;           // |difference| per pixel, scaled so the largest is white
};

// Runs a one-step warm-up, then `request` with strategy "single" and with `strategy` on `devices`.
Comparison compare(Engine& engine, GenerationRequest request, const std::string& strategy, int devices,
                   const JobObserver& observer, const CancelToken& cancel);

}  // namespace diffract::engine
