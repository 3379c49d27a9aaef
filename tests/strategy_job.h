#pragma once
// A pipeline job under a multi-device strategy (test_sd3_pipeline, test_cfg_pipefusion): the
// request with the strategy, device count, batch and patches set, run through the pipeline,
// and its metadata checked to name that strategy.
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "core/job/job.h"
#include "core/parallel/registry.h"
#include "core/pipeline/pipeline.h"
#include "core/util/error.h"

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

}  // namespace diffract::test
