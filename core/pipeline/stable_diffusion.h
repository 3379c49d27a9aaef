#pragma once
#include <filesystem>
#include <memory>
#include <string>

#include "core/engine/generation.h"
#include "core/pipeline/text_to_image.h"

namespace diffract::parallel {
class Strategy;
}

namespace diffract::pipeline {

enum class Family { SD1, SD2, SDXL };
std::string family_name(Family family);

// SD 1.x / 2.x / SDXL text-to-image: prompt -> text encoders -> CFG denoising loop -> VAE.
// Loads a diffusers folder or a single-file checkpoint once; generate() may run many times.
class StableDiffusion : public TextToImage {
 public:
  // `config_dir`: for a single-file checkpoint, a diffusers folder whose config.json files
  // describe its components (as diffusers' from_single_file(config=...)); optional.
  static std::unique_ptr<StableDiffusion> load(const std::filesystem::path& model, const std::string& device,
                                               const std::filesystem::path& config_dir = {});
  // The family's full-size architecture (or a few-channel `tiny` one) with random weights,
  // plus a random TAESD decoder under the name "<random>": for benchmarks, no files needed.
  static std::unique_ptr<StableDiffusion> random(Family family, bool tiny, const std::string& device);
  ~StableDiffusion() override;
  struct Impl;

  Family family() const;
  const std::filesystem::path& path() const override;
  const std::string& device() const override;
  int native_size() const override;  // pixels, square

  // One short job at the native size (2 steps, CFG, previews) so that cuDNN's plans, the CUDA
  // graph of the default shape and the allocator's pools exist before the first real job.
  // Returns its time in ms; a no-op (0) on the CPU.
  double warm_up() override;

  // Diagnostics for the benchmarks: one UNet call of `rows` rows at size² pixels on random
  // inputs, timed eager and from CUDA graphs in both layouts, with our GroupNorm kernels and with
  // ATen's; JSON {"eager_ms", "graph_ms", "graph_channels_last_ms", "graph_aten_group_norm_ms",
  // "graph_channels_last_aten_group_norm_ms", each graph's "..._capture_ms", "capture_ms" (the
  // NCHW graph's), Kineto "kernels" / "kernels_channels_last"}. GPU only; the pipeline's runner
  // keeps its layout.
  std::string profile_unet_step(int size, int rows, int reps);

  // Runs one job on the calling thread. Throws diffract::Error with a readable message,
  // or engine::Cancelled when `cancel` fires (checked between steps).
  engine::GenerationResult generate(const engine::GenerationRequest& request, const engine::JobObserver& observer,
                                    const engine::CancelToken& cancel) override;
  // The same with the denoising loop run by a multi-device strategy (core/parallel/strategies.h)
  // on CPU virtual devices; null runs the built-in loop. Its statistics go into metadata_json
  // under "strategy".
  engine::GenerationResult generate(const engine::GenerationRequest& request, const engine::JobObserver& observer,
                                    const engine::CancelToken& cancel, const parallel::Strategy* strategy);

 private:
  explicit StableDiffusion(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace diffract::pipeline
