#pragma once
#include <filesystem>
#include <memory>
#include <set>
#include <string>

#include "core/engine/generation.h"

namespace diffract::pipeline {

// What the engine needs of a loaded text-to-image model, whatever its family: SD 1.x / 2.x /
// SDXL (StableDiffusion) or SD3 (StableDiffusion3).
class TextToImage {
 public:
  virtual ~TextToImage() = default;
  virtual const std::filesystem::path& path() const = 0;
  virtual const std::string& device() const = 0;
  virtual int native_size() const = 0;  // pixels, square
  // A short job so that the first real one runs at full speed on a GPU; ms, 0 on the CPU.
  virtual double warm_up() = 0;
  // On a GPU, a 2-step job of the request's size, batch, CFG and previews, once per such shape
  // (graph capture, cuDNN plans, allocator growth: 1.7x the time of later jobs for SDXL at
  // batch 4), so that its first real job runs at full speed. warm_up() covers the native size
  // at batch 1. Single-device jobs only (strategies warm their ranks themselves). Returns ms;
  // 0 when there was nothing to do.
  double prepare(const engine::GenerationRequest& request);
  // Runs one job on the calling thread. Throws diffract::Error with a readable message, or
  // engine::Cancelled when `cancel` fires (checked between steps).
  virtual engine::GenerationResult generate(const engine::GenerationRequest& request, const engine::JobObserver& observer,
                                            const engine::CancelToken& cancel) = 0;

 private:
  std::set<std::string> prepared_;
};

// Whether `model` is a diffusers SD3 folder: model_index.json's _class_name names a
// StableDiffusion3 pipeline, or its transformer component is an SD3Transformer2DModel.
bool is_sd3_folder(const std::filesystem::path& model);

// The pipeline for `model` (a diffusers folder or a single-file checkpoint), chosen from its
// model_index.json or, for a .safetensors file, its tensor names: StableDiffusion3 for SD3 folders
// and SD3 / SD3.5 single files (an MMDiT's joint_blocks), StableDiffusion otherwise. `config_dir`:
// the single-file config folder (either family). `drop_t5`: an SD3 model's T5 encoder is not
// loaded (ignored by the other families).
std::unique_ptr<TextToImage> load_text_to_image(const std::filesystem::path& model, const std::string& device,
                                                const std::filesystem::path& config_dir = {}, bool drop_t5 = false);

}  // namespace diffract::pipeline
