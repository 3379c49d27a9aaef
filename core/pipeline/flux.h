#pragma once
#include <filesystem>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "core/job/job.h"
#include "core/pipeline/pipeline.h"

namespace diffract::pipeline {

// Flux.1 (dev, schnell) text-to-image as diffusers' FluxPipeline: prompt -> CLIP-L's pooled
// output and T5-XXL's max_sequence_length tokens -> flow-matching Euler over the pipeline's
// linspace(1, 1/n, n) sigmas, shifted by the image's token count when the scheduler says so
// (dev) -> FluxTransformer2DModel on 2x2-packed latents, with the distilled guidance
// (request.guidance) when the transformer embeds it -> the 16-channel AutoencoderKL (scaling and
// shift undone).
//
// CFG: Flux is guidance-distilled; a CFG scale above 1 *with a negative prompt* turns on true
// CFG (two evaluations a step, diffusers' true_cfg_scale); without a negative prompt the job runs
// without CFG and its metadata says cfg 1.
// T5 runs in bf16 on CUDA, fp32 on the CPU; a build without SentencePiece cannot load Flux.
// Prompt syntax: A1111's emphasis has no meaning for a pooled CLIP output and T5, so both read
// the prompt with the syntax removed (text::plain_text).
// Multi-device strategies: the registry says which run Flux (those that evaluate whole steps).
struct FluxLoadOptions {
  // T5's tokens: 0 takes the model's (512 with the guidance embedding, as Flux.1-dev; 256
  // without, as schnell was trained).
  int max_sequence_length = 0;
  // Single files: a diffusers FLUX.1 folder for the components and configs the file lacks
  // (load_flux_single_file). Ignored, with a warning, for a folder.
  std::filesystem::path config_dir;
  // Where T5 lives (job::GenerationRequest::t5_placement): "" with the model; "cpu" (it runs there
  // in fp32, loaded there: the GPU never holds it); "cuda:N" (another GPU, bf16); "offload" (bf16 in
  // host memory between prompts, moved to the model's GPU for an encoding: the GPU holds it only
  // while a new prompt is encoded). Prompt embeddings are cached per prompt in every placement.
  std::string t5_placement;
};

class Flux : public Pipeline {
 public:
  using LoadOptions = FluxLoadOptions;
  // A diffusers FluxPipeline folder: transformer, vae, text_encoder (CLIP-L), tokenizer,
  // text_encoder_2 (T5), tokenizer_2 (with spiece.model) and scheduler; or a FLUX.1 single file
  // (BFL's, ComfyUI's, float8 ones: core/pipeline/single_file.h) with options.config_dir for what it
  // lacks. Errors name the missing or mismatched component.
  static std::unique_ptr<Flux> load(const std::filesystem::path& model, const std::string& device,
                                    const LoadOptions& options = {});
  // Flux.1-dev's (or schnell's) transformer and VAE, or a few-channel `tiny` pair, with random
  // weights built on the device, no T5 (its tokens zeros: what diffusers' anchor times is the
  // transformer), a random TAEF1 under the name "<random>": for benchmarks, no files needed.
  static std::unique_ptr<Flux> random(bool tiny, bool schnell, const std::string& device);
  ~Flux() override;
  struct Impl;

  job::ModelFamily family() const override { return job::ModelFamily::Flux; }
  int native_size() const override;
  bool guidance_embedded() const;  // dev: the transformer takes request.guidance
  int max_sequence_length() const;
  std::string t5_placement() const;  // where T5 is now: "cpu", "cuda:0", ... ("offload": "cpu (offload)")

  // What diffusers' encode_prompt(prompt, num_images_per_prompt=batch, max_sequence_length=...)
  // gives: T5's [batch, max_sequence_length, 4096] and CLIP's pooled [batch, 768]. Cached per
  // prompt text (the last few), so a job with the same prompt skips the encoders.
  struct Conditioning {
    at::Tensor prompt_embeds, pooled;
  };
  Conditioning encode_prompt(const std::string& prompt, int batch, job::StageTimings* timings = nullptr,
                             job::PromptSyntax syntax = job::PromptSyntax::A1111);

  using Pipeline::generate;
  // A job from given initial latents [batch, 16, height / 8, width / 8] (unpacked), as
  // diffusers' pipeline(latents=pack(...)).
  job::GenerationResult generate(const job::GenerationRequest& request, const job::JobObserver& observer,
                                 const job::CancelToken& cancel, const at::Tensor& initial_latents);

  // The transformer's step at `size`² on the GPU (batch 1, the model's text length), eager and
  // CUDA-graphed, and where its kernel time goes (kernel_profile), as JSON: for the bench.
  std::string profile_transformer_step(int size, int reps);

  DIFFRACT_PIPELINE_HOOKS

 protected:
  bool guided(const job::GenerationRequest& request) const override;
  void fit_schedule(schedulers::SchedulerConfig& config, int width, int height) const override;
  std::string a1111_extra(const JobContext& job) const override;

 private:
  explicit Flux(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace diffract::pipeline
