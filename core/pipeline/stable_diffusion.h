#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "core/job/job.h"
#include "core/pipeline/pipeline.h"

namespace diffract::parallel {
class Strategy;
}

namespace diffract::pipeline {

// SD 1.x / 2.x / SDXL: prompt -> CLIP text encoders -> CFG denoising loop over the UNet -> VAE,
// as the hooks of the shared skeleton (pipeline.h). Loads a diffusers folder or a single-file
// checkpoint once; generate() may run many times.
class StableDiffusion : public Pipeline {
 public:
  // `config_dir`: for a single-file checkpoint, a diffusers folder whose config.json files
  // describe its components (as diffusers' from_single_file(config=...)); optional.
  static std::unique_ptr<StableDiffusion> load(const std::filesystem::path& model, const std::string& device,
                                               const std::filesystem::path& config_dir = {});
  // The family's full-size architecture (or a few-channel `tiny` one) with random weights,
  // plus a random TAESD decoder under the name "<random>": for benchmarks, no files needed.
  static std::unique_ptr<StableDiffusion> random(job::ModelFamily family, bool tiny, const std::string& device);
  // A ControlNet folder for this model's UNet with random weights (the benchmark's; seeded).
  void write_random_controlnet(const std::filesystem::path& dir, std::uint64_t seed) const;
  ~StableDiffusion() override;
  struct Impl;

  job::ModelFamily family() const override;
  int native_size() const override;  // pixels, square

  // Diagnostics for the benchmarks: one UNet call of `rows` rows at size² pixels on random
  // inputs, timed eager and from CUDA graphs in both layouts, with our GroupNorm kernels and with
  // ATen's; JSON {"eager_ms", "graph_ms", "graph_channels_last_ms", "graph_aten_group_norm_ms",
  // "graph_channels_last_aten_group_norm_ms", each graph's "..._capture_ms", "capture_ms" (the
  // NCHW graph's), Kineto "kernels" / "kernels_channels_last"}. GPU only; the pipeline's runner
  // keeps its layout.
  std::string profile_unet_step(int size, int rows, int reps);

  using Pipeline::generate;
  // A job with its denoising loop run by a given multi-device strategy (core/parallel); null runs
  // the request's. Its statistics go into metadata_json under "strategy".
  job::GenerationResult generate(const job::GenerationRequest& request, const job::JobObserver& observer,
                                 const job::CancelToken& cancel, const parallel::Strategy* strategy);

  DIFFRACT_PIPELINE_HOOKS
  void before_warm_up() override;

 private:
  explicit StableDiffusion(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace diffract::pipeline
