#pragma once
// Speed and quality of one finished job against another. No torch headers.
#include "core/io/image.h"
#include "core/job/result.h"

namespace diffract::engine {

// One finished job against a baseline job of the same request and seed.
struct Measures {
  double speedup = 0;          // baseline / other time, text encode to decoded image (model load excluded)
  double psnr = 0;             // first images, dB (infinite when identical)
  double ssim = 0;
  double latents_rel_l2 = 0;   // ||a - b|| / ||b|| of the final latents, b the baseline
  io::Image heatmap;           // |difference| per pixel, scaled so the largest is white
};

// A short job that pays `request`'s first-use costs (model load, cuDNN plans, graph captures;
// with `with_strategy` also its strategy's replicas and ranks) before a timed run: one step of
// the plain loop, or two of the strategy; no previews, no hires pass.
job::GenerationRequest warm_up_job(const job::GenerationRequest& request, bool with_strategy);

// Throws diffract::Error when the two jobs' first images differ in size.
Measures measure(const job::GenerationResult& other, const job::GenerationResult& baseline);

}  // namespace diffract::engine
