#pragma once
// A pipeline job under a multi-device strategy (test_sd3_pipeline, test_cfg_pipefusion): the
// request with the strategy, device count, batch and patches set, run through the pipeline,
// and its metadata checked to name that strategy.
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "core/engine/generation.h"
#include "core/pipeline/text_to_image.h"
#include "core/util/error.h"

namespace diffract::test {

// A result's final latents as a tensor of its own.
inline at::Tensor latents_tensor(const engine::GenerationResult& g) {
  return at::from_blob(const_cast<float*>(g.latents.data()), g.latents_shape, at::kFloat).clone();
}

// The job's final latents and the strategy's stats (metadata "strategy"); throws when the
// metadata names another strategy or device count.
inline std::pair<at::Tensor, nlohmann::json> strategy_job(pipeline::TextToImage& pipe, engine::GenerationRequest r,
                                                          const std::string& name, int devices, int batch, int patches,
                                                          const engine::JobObserver& observer) {
  r.strategy = name;
  r.devices = devices;
  r.batch = batch;
  r.patches = patches;
  const auto result = pipe.generate(r, observer, engine::CancelToken{});
  const auto meta = nlohmann::json::parse(result.metadata_json);
  if (meta["strategy_name"].get<std::string>() != name || meta["devices"].get<int>() != devices ||
      meta["strategy"]["strategy"].get<std::string>() != name)
    throw Error("metadata names the wrong strategy: " + result.metadata_json);
  return {latents_tensor(result), meta["strategy"]};
}

}  // namespace diffract::test
