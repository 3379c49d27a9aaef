#include "core/parallel/step_caches.h"

#include <atomic>

#include <ATen/ATen.h>

#include "core/models/common/block_cache.h"
#include "core/parallel/loop_util.h"
#include "core/util/error.h"
#include "core/util/options.h"

namespace diffract::parallel {

using namespace detail;

std::string StepCaching::prefix() const {
  return split == CacheSplit::Cfg ? "cfg-" : split == CacheSplit::Batch ? "dp-" : "";
}

LoopOutput StepCaching::run(DeviceGroup& g, const LoopInputs& in) const {
  auto ranks = prepare(*this, g, in);
  const std::int64_t batch = in.latents.size(0);
  std::vector<std::unique_ptr<models::StepCache>> caches;
  for (auto& k : ranks) {
    caches.push_back(make_cache(*k.den));
    if (!caches.back() || !k.den->step_cache(*caches.back()))
      throw Error(name() + " does not run this model: " + refused_why());
  }
  std::vector<int> reused;
  std::atomic<int> evals{0};
  std::atomic<std::int64_t> bytes{0};
  double work = 0;
  at::Tensor result;
  CancelGate gate(in.cancel);
  g.run([&](int rank, Communicator& comm) {
    auto& k = ranks[static_cast<std::size_t>(rank)];
    auto& cache = *caches[static_cast<std::size_t>(rank)];
    const auto dev = g.device(rank);
    const auto bytes0 = comm.bytes_sent();
    if (split != CacheSplit::None)
      cache.combine = [&comm, dev](double& changed, double& total) {
        // On the rank's device: NCCL gathers device tensors only.
        const auto both = comm.all_gather(at::tensor({changed, total}, at::kDouble).to(dev));
        std::vector<at::Tensor> here;
        for (const auto& t : both) here.push_back(t.to(dev));
        const auto all = at::stack(here).to(at::kCPU);  // one read from the device
        changed = total = 0;
        for (std::int64_t r = 0; r < all.size(0); ++r) {  // in rank order on every rank: the same sums everywhere
          changed += all[r][0].item<double>();
          total += all[r][1].item<double>();
        }
      };
    // dp-: this rank's images of the batch, through the denoiser over their conditioning rows.
    const auto share = split == CacheSplit::Batch ? batch_slice(batch, n, rank) : BatchSlice{0, batch, batch};
    std::unique_ptr<Denoiser> rows;
    if (split == CacheSplit::Batch) rows = k.den->rows(share.begin, share.count);
    Denoiser& den = rows ? *rows : *k.den;
    auto x = split == CacheSplit::Batch ? k.x.narrow(0, share.begin, share.count).contiguous() : k.x;
    cache.steps = k.sampler->num_steps() - in.first_step;
    cache.warmup = cache.steps * std::stoi(options::value(options::Id::CacheWarmup)) / 100;
    for (int i = in.first_step; i < k.sampler->num_steps(); ++i) {
      gate.check(i);
      cache.step = i - in.first_step;
      const auto input = k.sampler->scale_model_input(x, i);
      const double t = k.sampler->timesteps().at(static_cast<std::size_t>(i));
      at::Tensor out;
      if (split == CacheSplit::Cfg) {
        const auto mine = den.eval_cached(input, t, rank == 0 ? Branch::Cond : Branch::Uncond, cache);
        const auto both = comm.all_gather(mine);
        out = combine_cfg(both[1].to(dev), both[0].to(dev), den.guidance_scale());
      } else {
        out = den.eval_cached(input, t, Branch::Guided, cache);
      }
      if (!cache.reused) ++evals;
      if (rank == 0) {
        if (cache.reused) {
          reused.push_back(i);
          work += cache.reused_work;
          if (in.on_cached) in.on_cached(i);
        } else {
          work += 1;
        }
      }
      x = refine(k, rank, in, out, i, x);  // dp-: on_step reports rank 0's images
    }
    if (split == CacheSplit::Batch) {
      auto all = gather_batch(comm, x, batch, n, rank == 0 ? std::optional(g.device(0)) : std::nullopt);
      if (rank == 0) result = all;
    } else if (rank == 0) {
      result = x;
    }
    bytes += comm.bytes_sent() - bytes0;
  });
  auto o = finish(*this, in, g, result, in.steps - in.first_step, evals.load(), bytes.load());
  o.stats.cache_threshold = stats_threshold();
  o.stats.reused_steps = reused;
  o.stats.model_work = work;
  return o;
}

void StepCaching::validate(std::int64_t batch, bool cfg) const {
  if (split == CacheSplit::Cfg && !cfg) throw Error(name() + " needs classifier-free guidance (a CFG scale above 1)");
  if (split == CacheSplit::Batch) {
    if (n < 1) throw Error(name() + " needs 1 or more devices, not " + std::to_string(n));
    if (batch < n)
      throw Error(name() + " splits the batch's images over the devices: on " + std::to_string(n) +
                  " devices it needs a batch of at least " + std::to_string(n) + ", not " + std::to_string(batch));
  }
}

namespace {

// Two evaluations of `x` through a cache of s's kind, set to run in full, then to reuse.
void warm_through_cache(const StepCaching& s, Denoiser& d, const at::Tensor& x, double timestep, Branch branch) {
  auto cache = s.make_cache(d);
  if (!cache || !d.step_cache(*cache)) {
    d.eval(x, timestep, branch);
    return;
  }
  if (auto* deep = dynamic_cast<models::DeepCache*>(cache.get())) {
    deep->interval = 2;
    if (deep->threshold > 0) deep->threshold = 1e9;  // the second call reuses
  }
  cache->steps = 3;
  for (int i = 0; i < 2; ++i) {
    cache->step = i;
    d.eval_cached(x, timestep, branch, *cache);
  }
}

}  // namespace

void StepCaching::warm(Denoiser& d, const at::Tensor& x, double timestep) const {
  if (split == CacheSplit::Batch) {  // every share's size, as data-parallel warms them
    for (const auto rows : share_sizes(x.size(0), n))
      warm_through_cache(*this, *d.rows(0, rows), x.narrow(0, 0, rows), timestep, Branch::Guided);
    return;
  }
  // The cfg- variants run one branch per device: Cond and Uncond share a shape.
  warm_through_cache(*this, d, x, timestep, split == CacheSplit::Cfg ? Branch::Cond : Branch::Guided);
}

void FirstBlockCaching::validate(std::int64_t batch, bool cfg) const {
  StepCaching::validate(batch, cfg);
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

void TeaCaching::validate(std::int64_t batch, bool cfg) const {
  StepCaching::validate(batch, cfg);
  if (!(threshold >= 0)) throw Error("teacache: the threshold must be 0 or more");
}

std::unique_ptr<models::StepCache> TeaCaching::make_cache(const Denoiser& den) const {
  auto c = std::make_unique<models::TeaCache>();
  c->threshold = threshold;
  if (dynamic_cast<const FluxDenoiser*>(&den)) c->coefficients = models::TeaCache::flux();
  return c;
}

void DeepCaching::validate(std::int64_t batch, bool cfg) const {
  StepCaching::validate(batch, cfg);
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
