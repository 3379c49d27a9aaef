#include "core/parallel/first_block_cache.h"

#include <ATen/ATen.h>

#include "core/models/common/block_cache.h"
#include "core/parallel/loop_util.h"
#include "core/util/error.h"

namespace diffract::parallel {

using namespace detail;

void FirstBlockCaching::validate(std::int64_t, bool) const {
  if (!(threshold >= 0)) throw Error("fbcache: the threshold must be 0 or more");
}

LoopOutput FirstBlockCaching::run(DeviceGroup& g, const LoopInputs& in) const {
  auto ranks = prepare(*this, g, in);
  if (!ranks.front().den->block_cache())
    throw Error("fbcache runs SD3 and Flux models: this model's blocks cannot be cached");
  std::vector<int> reused;
  int evals = 0;
  at::Tensor result;
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator&) {
    auto& k = ranks[static_cast<std::size_t>(rank)];
    models::FirstBlockCache cache;
    cache.threshold = threshold;
    for (int i = in.first_step; i < k.sampler->num_steps(); ++i) {
      gate.check(i);
      const auto out = k.den->eval_block_cached(k.sampler->scale_model_input(k.x, i),
                                                k.sampler->timesteps().at(static_cast<std::size_t>(i)), Branch::Guided,
                                                cache);
      if (cache.reused) {
        reused.push_back(i);
        if (in.on_cached) in.on_cached(i);
      } else {
        ++evals;
      }
      k.x = refine(k, rank, in, out, i, k.x);
    }
    result = k.x;
  });
  auto o = finish(*this, in, g, result, in.steps - in.first_step, evals, 0);
  o.stats.cache_threshold = threshold;
  o.stats.reused_steps = reused;
  return o;
}

}  // namespace diffract::parallel
