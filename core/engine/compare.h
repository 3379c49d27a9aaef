#pragma once
#include <string>

#include "core/engine/engine.h"
#include "core/engine/measures.h"

namespace diffract::engine {

// A strategy against the plain single-device loop, same request and seed.
struct Comparison : Measures {
  job::GenerationResult baseline;
  job::GenerationResult accelerated;
};

// metrics::relative_l2 of two jobs' final latents, `b` the baseline.
double latents_rel_l2(const job::GenerationResult& a, const job::GenerationResult& b);

// Runs short warm-up jobs (the plain loop, then the strategy), then `request` with strategy "single" and with `strategy`.
Comparison compare(Engine& engine, job::GenerationRequest request, const job::StrategyParams& strategy,
                   const job::JobObserver& observer, const job::CancelToken& cancel);

}  // namespace diffract::engine
