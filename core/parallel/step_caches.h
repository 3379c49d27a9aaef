#pragma once
// The step caches as strategies (DESIGN.md, level 2: what of an evaluation runs), one device
// each, approximate: each step evaluates the model through a models::StepCache
// (models/common/block_cache.h says what each keeps and reuses) and the stats list the steps
// that reused cached work (LoopStats::reused_steps; LoopInputs::on_cached tells the live view).
//  fbcache    First-Block Cache (ParaAttention's FBCache; xDiT and cache-dit ship it too). SD3,
//             Flux: the first block every step, the others reused while its residual moved less
//             than `threshold`. SD / SDXL: its UNet analogue, the first down layer every step
//             and DeepCache's shallow path around it (branch 1), the deep rest refreshed when
//             that layer's residual moved more than `threshold`.
//  teacache   TeaCache: SD3, Flux; every block skipped while the first block's modulated input
//             moved little, its rescaled changes summed to under `threshold` (Flux's published
//             polynomial; SD3 has none published: the plain change, as xDiT's default).
//  deepcache  DeepCache: SD / SDXL; the deep part of the UNet every `interval`-th step, the
//             shallow path (DeepCache's branch, DIFFRACT_DEEPCACHE_BRANCH, default 0) in between.
// Threshold 0 (interval 1) reuses nothing: the plain loop's result. The decisions are made once
// for the whole CFG batch, as a one-thread replay makes them.
// cfg-fbcache, cfg-teacache, cfg-deepcache: the same caches composed with CFG-parallel, the
// prompt's branch on one device and the negative prompt's on another, each with its own cache;
// a decision reads the change summed over both branches (StepCache::combine, one all-gather of two
// numbers), so both devices reuse the same steps as the one-device cache does.
// dp-fbcache, dp-teacache: composed with data-parallel, the batch's images split over the devices
// as data-parallel splits them, each device's cache deciding on the change summed over the whole
// batch (the same combine), so every device reuses the steps the one-device cache reuses for that
// batch. (DeepCache's decisions are its interval's, the same on every device; a strategy takes
// one count, which for deepcache is its interval, so no dp-deepcache is offered.)
// DIFFRACT_CACHE_WARMUP (percent of
// the steps, default 10; 0 gives the published schedules) keeps the loop's first steps in full,
// where the image's layout forms: on the embedded model deepcache x3 without it turned a black
// background light (PSNR 4.9 dB against the plain loop), with 10 % 32.2 dB.
#include <cstdint>
#include <memory>
#include <string>

#include "core/parallel/strategy.h"

namespace diffract::models {
struct StepCache;
}

namespace diffract::parallel {

// How a step cache's work is split over devices: not at all, the CFG branches on two (cfg-),
// the batch's images over `n` (dp-).
enum class CacheSplit { None, Cfg, Batch };

// What the three share: the loop over steps through a fresh cache of the strategy's kind.
struct StepCaching : Strategy {
  CacheSplit split = CacheSplit::None;
  int n = 2;  // CacheSplit::Batch: the devices
  int devices() const override { return split == CacheSplit::Cfg ? 2 : split == CacheSplit::Batch ? n : 1; }
  // "", "cfg-" or "dp-": the name's prefix for the split.
  std::string prefix() const;
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
  // Two evaluations through a cache set to run in full, then to reuse: a UNet's stage graphs for
  // both paths are captured here, not inside the loop's time (dp-: for each slice's row count).
  void warm(Denoiser& d, const at::Tensor& x, double timestep) const override;
  // A new cache for one loop of `den`, of the kind it runs (null: it runs none of this strategy's).
  virtual std::unique_ptr<models::StepCache> make_cache(const Denoiser& den) const = 0;
  // The threshold the stats report (negative: none).
  virtual double stats_threshold() const { return -1; }
  // Why a model whose denoiser runs none of this strategy's caches is refused.
  virtual std::string refused_why() const { return "it caches a transformer's blocks (SD3, Flux)"; }
};

struct FirstBlockCaching final : StepCaching {
  double threshold = 0.12;
  std::string name() const override { return prefix() + "fbcache"; }
  void validate(std::int64_t batch, bool cfg) const override;
  std::unique_ptr<models::StepCache> make_cache(const Denoiser& den) const override;
  double stats_threshold() const override { return threshold; }
  // A UNet's shallow path: conv_in and the first down layer (whose residual decides), the last
  // two up layers, the head.
  static constexpr int kUNetBranch = 1;
};

struct TeaCaching final : StepCaching {
  double threshold = 0.4;  // TeaCache4FLUX: 0.25 about 1.5x, 0.4 1.8x, 0.6 2.0x, 0.8 2.25x on Flux.1-dev
  std::string name() const override { return prefix() + "teacache"; }
  void validate(std::int64_t batch, bool cfg) const override;
  std::unique_ptr<models::StepCache> make_cache(const Denoiser& den) const override;
  double stats_threshold() const override { return threshold; }
};

struct DeepCaching final : StepCaching {
  int interval = 3;  // DeepCache's cache_interval (its default for SD / SDXL: 3)
  int branch = 0;    // DeepCache's cache_branch_id: down layers in the shallow path
  std::string name() const override { return prefix() + "deepcache"; }
  void validate(std::int64_t batch, bool cfg) const override;
  std::unique_ptr<models::StepCache> make_cache(const Denoiser& den) const override;
  std::string refused_why() const override { return "DeepCache splits a UNet (SD 1.x / 2.x / XL)"; }
};

}  // namespace diffract::parallel
