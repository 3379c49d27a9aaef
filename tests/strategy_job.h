#pragma once
// A pipeline job under a multi-device strategy (test_sd3_pipeline, test_cfg_pipefusion): the
// request with the strategy, device count, batch and patches set, run through the pipeline,
// and its metadata checked to name that strategy; and the step caches' checks the transformer
// families share.
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "core/job/job.h"
#include "core/parallel/registry.h"
#include "core/pipeline/pipeline.h"
#include "core/util/error.h"
#include "test_util.h"

namespace diffract::test {

// A result's final latents as a tensor of its own.
inline at::Tensor latents_tensor(const job::GenerationResult& g) {
  return at::from_blob(const_cast<float*>(g.latents.data()), g.latents_shape, at::kFloat).clone();
}

// The job's final latents and the strategy's stats (metadata "strategy"); throws when the
// metadata names another strategy or device count.
inline std::pair<at::Tensor, nlohmann::json> strategy_job(pipeline::Pipeline& pipe, job::GenerationRequest r,
                                                          const std::string& name, int devices, int batch, int patches,
                                                          const job::JobObserver& observer) {
  const auto* info = parallel::find_strategy(name);
  const bool skips = info && info->takes(parallel::Param::Skip);  // step-skip: `devices` is its skip factor
  r.strategy.name = name;
  (skips ? r.strategy.skip : r.strategy.devices) = devices;
  r.batch = batch;
  r.strategy.patches = patches;
  const auto result = pipe.generate(r, observer, job::CancelToken{});
  const auto meta = nlohmann::json::parse(result.metadata_json);
  if (meta["strategy_name"].get<std::string>() != name || (skips ? meta["skip"] : meta["devices"]).get<int>() != devices ||
      meta["strategy"]["strategy"].get<std::string>() != name)
    throw Error("metadata names the wrong strategy: " + result.metadata_json);
  return {latents_tensor(result), meta["strategy"]};
}

// The First-Block Cache on `r` (a job of `steps` steps whose plain loop gave `base`): threshold 0
// is the plain loop; above any change every step after the first reuses the other blocks; in
// between, the same decisions every run; one above 10 is refused, a negative one is the default.
inline void check_first_block_cache(pipeline::Pipeline& pipe, job::GenerationRequest r, const at::Tensor& base,
                                    int steps) {
  const auto rel = [&](const at::Tensor& a) { return ((a - base).norm() / base.norm()).item<double>(); };
  r.strategy.cache_threshold = 0;
  const auto [exact, exact_stats] = strategy_job(pipe, r, "fbcache", 1, 1, 0, {});
  DIFFRACT_COMPARE_TENSORS(exact, base, 1e-6);
  QVERIFY(exact_stats["reused_steps"].empty());
  QCOMPARE(exact_stats["evaluations"].get<int>(), steps);
  r.strategy.cache_threshold = 10;
  const auto [reuse, reuse_stats] = strategy_job(pipe, r, "fbcache", 1, 1, 0, {});
  std::vector<int> after_first;
  for (int i = 1; i < steps; ++i) after_first.push_back(i);
  QCOMPARE(reuse_stats["reused_steps"].get<std::vector<int>>(), after_first);
  QCOMPARE(reuse_stats["evaluations"].get<int>(), 1);
  QVERIFY(at::isfinite(reuse).all().item<bool>() && rel(reuse) > 0);
  qInfo("fbcache threshold 10: relative L2 to one device %.3g", rel(reuse));
  r.strategy.cache_threshold = 0.5;
  const auto [mid, mid_stats] = strategy_job(pipe, r, "fbcache", 1, 1, 0, {});
  const auto [again, again_stats] = strategy_job(pipe, r, "fbcache", 1, 1, 0, {});
  QVERIFY(at::equal(mid, again));
  QCOMPARE(mid_stats["reused_steps"], again_stats["reused_steps"]);
  qInfo("fbcache threshold 0.5: reused %s, relative L2 %.3g", mid_stats["reused_steps"].dump().c_str(), rel(mid));
  r.strategy.cache_threshold = 11;
  DIFFRACT_EXPECT_ERROR(strategy_job(pipe, r, "fbcache", 1, 1, 0, {}), "cache threshold", "between 0");
  r.strategy.cache_threshold = -1;  // the strategy's default
  QCOMPARE(strategy_job(pipe, r, "fbcache", 1, 1, 0, {}).second["cache_threshold"].get<double>(), 0.12);
}

}  // namespace diffract::test
