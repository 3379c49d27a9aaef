#pragma once
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

 protected:
  PipelineState& state() override;
  int size_multiple() const override;
  std::string size_multiple_why() const override;
  schedulers::SamplerKind choose_sampler(const std::string& requested) const override;
  schedulers::SchedulerConfig scheduler_config(schedulers::SamplerKind kind) const override;
  std::string a1111_sampler(schedulers::SamplerKind kind) const override;
  int latent_channels() const override;
  int vae_factor() const override;
  std::string taesd_hint() const override;
  void encode(JobContext& job) override;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> denoiser(JobContext& job) override;
  void prepare_ranks(JobContext& job, const parallel::Strategy& strategy, parallel::DeviceGroup& group) override;
  std::unique_ptr<parallel::Denoiser> rank_denoiser(const JobContext& job, const parallel::Strategy& strategy, int rank,
                                                    const c10::Device& device) override;
  double warm_timestep(const JobContext& job, const schedulers::Sampler& sampler) const override;
  at::Tensor preview(const at::Tensor& x0, bool use_taesd, int max_side) override;
  at::Tensor decode(const at::Tensor& latents, parallel::DeviceGroup* group) override;
  void add_metadata(const JobContext& job, nlohmann::json& meta) const override;
  std::string nan_hint() const override;
  void before_warm_up() override;

 private:
  explicit StableDiffusion(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace diffract::pipeline
