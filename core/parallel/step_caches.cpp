#include "core/parallel/step_caches.h"

#include <ATen/ATen.h>

#include "core/models/common/block_cache.h"
#include "core/parallel/loop_util.h"
#include "core/util/error.h"
#include "core/util/options.h"

namespace diffract::parallel {

using namespace detail;

LoopOutput StepCaching::run(DeviceGroup& g, const LoopInputs& in) const {
  auto ranks = prepare(*this, g, in);
  auto cache = make_cache(*ranks.front().den);
  if (!cache || !ranks.front().den->step_cache(*cache))
    throw Error(name() + " does not run this model: " + refused_why());
  std::vector<int> reused;
  int evals = 0;
  double work = 0;
  at::Tensor result;
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator&) {
    auto& k = ranks[static_cast<std::size_t>(rank)];
    cache->steps = k.sampler->num_steps() - in.first_step;
    cache->warmup = cache->steps * std::stoi(options::value(options::Id::CacheWarmup)) / 100;
    for (int i = in.first_step; i < k.sampler->num_steps(); ++i) {
      gate.check(i);
      cache->step = i - in.first_step;
      const auto out = k.den->eval_cached(k.sampler->scale_model_input(k.x, i),
                                          k.sampler->timesteps().at(static_cast<std::size_t>(i)), Branch::Guided, *cache);
      if (cache->reused) {
        reused.push_back(i);
        work += cache->reused_work;
        if (in.on_cached) in.on_cached(i);
      } else {
        ++evals;
        work += 1;
      }
      k.x = refine(k, rank, in, out, i, k.x);
    }
    result = k.x;
  });
  auto o = finish(*this, in, g, result, in.steps - in.first_step, evals, 0);
  o.stats.cache_threshold = stats_threshold();
  o.stats.reused_steps = reused;
  o.stats.model_work = work;
  return o;
}

void StepCaching::warm(Denoiser& d, const at::Tensor& x, double timestep) const {
  auto cache = make_cache(d);
  if (!cache || !d.step_cache(*cache)) return Strategy::warm(d, x, timestep);
  if (auto* deep = dynamic_cast<models::DeepCache*>(cache.get())) {
    deep->interval = 2;
    if (deep->threshold > 0) deep->threshold = 1e9;  // the second call reuses
  }
  cache->steps = 3;
  for (int i = 0; i < 2; ++i) {
    cache->step = i;
    d.eval_cached(x, timestep, Branch::Guided, *cache);
  }
}

void FirstBlockCaching::validate(std::int64_t, bool) const {
  if (!(threshold >= 0)) throw Error("fbcache: the threshold must be 0 or more");
}

std::unique_ptr<models::StepCache> FirstBlockCaching::make_cache(const Denoiser& den) const {
  auto first_block = std::make_unique<models::FirstBlockCache>();
  first_block->threshold = threshold;
  if (den.step_cache(*first_block)) return first_block;
  // A UNet: DeepCache's split refreshed by threshold.
  auto deep = std::make_unique<models::DeepCache>();
  deep->branch = kUNetBranch;
  deep->threshold = threshold;
  return deep;
}

void TeaCaching::validate(std::int64_t, bool) const {
  if (!(threshold >= 0)) throw Error("teacache: the threshold must be 0 or more");
}

std::unique_ptr<models::StepCache> TeaCaching::make_cache(const Denoiser& den) const {
  auto c = std::make_unique<models::TeaCache>();
  c->threshold = threshold;
  if (dynamic_cast<const FluxDenoiser*>(&den)) c->coefficients = models::TeaCache::flux();
  return c;
}

void DeepCaching::validate(std::int64_t, bool) const {
  if (interval < 1) throw Error("deepcache: the interval must be 1 (every step in full) or more, not " + std::to_string(interval));
  if (branch < 0) throw Error("deepcache: the branch must be 0 or more, not " + std::to_string(branch));
}

std::unique_ptr<models::StepCache> DeepCaching::make_cache(const Denoiser&) const {
  auto c = std::make_unique<models::DeepCache>();
  c->interval = interval;
  c->branch = branch;
  return c;
}

}  // namespace diffract::parallel
