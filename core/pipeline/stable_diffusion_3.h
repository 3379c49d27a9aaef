#pragma once
#include <filesystem>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "core/engine/generation.h"
#include "core/pipeline/text_to_image.h"

namespace diffract::pipeline {

// SD3 / SD3.5 text-to-image without the T5-XXL encoder, as diffusers' StableDiffusion3Pipeline
// runs with text_encoder_3=None: prompt -> CLIP-L and OpenCLIP-bigG (penultimate hidden states
// concatenated on channels and zero-padded to the transformer's joint_attention_dim, followed
// by max_sequence_length zero tokens where T5's would be; pooled = both projections
// concatenated) -> CFG flow-matching Euler loop over SD3Transformer2DModel -> the 16-channel
// AutoencoderKL (scaling and shift undone).
//
// T5: not supported yet. A folder whose model_index.json lists text_encoder_3 loads anyway:
// T5 is not loaded and its part of the embedding is zeros, with a warning at load and
// "t5": "dropped" in the job's metadata (diffusers' images with T5 differ from these).
// Multi-device strategies (request.strategy, core/parallel): cfg-parallel, driffusion(-aggressive),
// data-parallel and step-skip through parallel::SD3Denoiser, and pipefusion (its blocks split
// into stages, request.patches patches); hybrid-cfg needs a UNet's layer split and is refused.
// Single-file SD3 checkpoints are not supported yet.
class StableDiffusion3 : public TextToImage {
 public:
  // A diffusers SD3 folder: transformer, vae, text_encoder(_2), tokenizer(_2), scheduler.
  // Errors name the missing or mismatched component.
  static std::unique_ptr<StableDiffusion3> load(const std::filesystem::path& model, const std::string& device);
  ~StableDiffusion3() override;
  struct Impl;

  const std::filesystem::path& path() const override;
  const std::string& device() const override;
  int native_size() const;  // pixels, square
  bool t5_dropped() const;  // the folder lists a T5 encoder that is not used
  int max_sequence_length() const;  // the zero T5 tokens after CLIP's 77 (diffusers' default 256)

  double warm_up() override;

  // What diffusers' encode_prompt(prompt, negative_prompt=..., num_images_per_prompt=batch)
  // gives without T5: [batch, 77 + max_sequence_length, joint_attention_dim] and
  // [batch, pooled_projection_dim]; the negative pair only with `cfg` (empty negative: "").
  struct Conditioning {
    at::Tensor prompt_embeds, pooled, negative_prompt_embeds, negative_pooled;
  };
  Conditioning encode_prompt(const std::string& prompt, const std::string& negative, int batch, bool cfg,
                             engine::StageTimings* timings = nullptr);

  engine::GenerationResult generate(const engine::GenerationRequest& request, const engine::JobObserver& observer,
                                    const engine::CancelToken& cancel) override;
  // The same from given initial latents [batch, 16, height / 8, width / 8] (the request's seed
  // then only names the job), as diffusers' pipeline(latents=...).
  engine::GenerationResult generate(const engine::GenerationRequest& request, const engine::JobObserver& observer,
                                    const engine::CancelToken& cancel, const at::Tensor& initial_latents);

 private:
  explicit StableDiffusion3(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace diffract::pipeline
