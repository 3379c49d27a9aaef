#pragma once
#include <filesystem>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "core/job/job.h"
#include "core/pipeline/pipeline.h"

namespace diffract::pipeline {

// SD3 / SD3.5 text-to-image as diffusers' StableDiffusion3Pipeline: prompt -> CLIP-L and
// OpenCLIP-bigG (penultimate hidden states concatenated on channels and zero-padded to the
// transformer's joint_attention_dim) followed by T5-XXL's max_sequence_length tokens (pooled =
// both CLIP projections concatenated) -> CFG flow-matching Euler loop over
// SD3Transformer2DModel -> the 16-channel AutoencoderKL (scaling and shift undone).
//
// T5 (text_encoder_3 + tokenizer_3, SentencePiece) runs in bf16 on CUDA, fp32 on the CPU. It is
// dropped, its part of the embedding zeros as diffusers with text_encoder_3=None, when the
// folder has none, when asked (LoadOptions::drop_t5 or the request's drop_t5, the CLI's
// --no-t5), or when this build has no SentencePiece (a warning at load). The job's metadata
// says "t5": "used", "dropped" or "absent".
// Multi-device strategies (request.strategy, core/parallel): the registry says which run SD3
// (cfg-parallel, driffusion, data-parallel, step-skip through parallel::SD3Denoiser, pipefusion
// and cfg-pipefusion over its blocks) and why the UNet-only ones are refused.
// Single files: Stability's SD3 / SD3.5 .safetensors (core/pipeline/single_file.h,
// load_sd3_single_file) load as the folder does; their T5 needs config_dir/tokenizer_3 (a
// SentencePiece model), else it is dropped with a warning.
struct SD3LoadOptions {
  bool drop_t5 = false;  // leave a listed T5 encoder unloaded (saves its ~9.5 GB in bf16)
  // Single files only: a diffusers SD3 folder whose configs replace the inferred ones and whose
  // components fill what the file lacks (SingleFileOptions::config_dir).
  std::filesystem::path config_dir;
};

class StableDiffusion3 : public Pipeline {
 public:
  using LoadOptions = SD3LoadOptions;
  // A diffusers SD3 folder: transformer, vae, text_encoder(_2), tokenizer(_2), scheduler and,
  // when listed, text_encoder_3 / tokenizer_3; or an SD3 single file (.safetensors, .ckpt).
  // Errors name the missing or mismatched component.
  static std::unique_ptr<StableDiffusion3> load(const std::filesystem::path& model, const std::string& device,
                                                const LoadOptions& options = {});
  // SD3-medium's architecture (or a few-channel `tiny` one) with random weights and no T5 (its
  // 256 tokens zeros: the sequence diffusers' anchor times), a random TAESD3 decoder under the
  // name "<random>", flow-Euler with shift 3: for benchmarks, no files needed.
  static std::unique_ptr<StableDiffusion3> random(bool tiny, const std::string& device);
  ~StableDiffusion3() override;
  struct Impl;

  job::ModelFamily family() const override { return job::ModelFamily::SD3; }
  int native_size() const override;  // pixels, square
  bool has_t5() const;      // T5 is loaded
  bool t5_dropped() const;  // the folder lists a T5 encoder that is not loaded
  int max_sequence_length() const;  // T5's tokens after CLIP's 77 (diffusers' default 256)

  // What diffusers' encode_prompt(prompt, negative_prompt=..., num_images_per_prompt=batch)
  // gives: [batch, 77 + max_sequence_length, joint_attention_dim] and [batch,
  // pooled_projection_dim]; the negative pair only with `cfg` (an empty negative encodes "", as
  // diffusers' SD3 pipeline always does). T5's part is zeros without T5 or with `drop_t5`.
  // With A1111's syntax the CLIP part is 77 tokens a chunk, weighted; T5 reads the text without
  // the syntax; a prompt and a negative of different chunk counts have the shorter one padded
  // with the empty prompt's chunk (A1111's "pad prompt/negative prompt to be same length").
  struct Conditioning {
    at::Tensor prompt_embeds, pooled, negative_prompt_embeds, negative_pooled;
  };
  Conditioning encode_prompt(const std::string& prompt, const std::string& negative, int batch, bool cfg,
                             job::StageTimings* timings = nullptr, bool drop_t5 = false,
                             job::PromptSyntax syntax = job::PromptSyntax::A1111);

  // One denoiser step at size x size with both CFG branches (batch 2, the prompt's full sequence),
  // eager and CUDA-graphed, and where its kernel time goes (kernel_profile), as JSON: for the bench.
  std::string profile_transformer_step(int size, int reps);

  using Pipeline::generate;
  // A job from given initial latents [batch, 16, height / 8, width / 8] (the request's seed
  // then only names the job), as diffusers' pipeline(latents=...).
  job::GenerationResult generate(const job::GenerationRequest& request, const job::JobObserver& observer,
                                 const job::CancelToken& cancel, const at::Tensor& initial_latents);

  DIFFRACT_PIPELINE_HOOKS

 private:
  explicit StableDiffusion3(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace diffract::pipeline
