#pragma once
// Picks a model's family and loads it.
#include <filesystem>
#include <memory>
#include <string>

#include "core/pipeline/pipeline.h"

namespace diffract::pipeline {

// Whether `model` is a diffusers SD3 folder: model_index.json's _class_name names a
// StableDiffusion3 pipeline, or its transformer component is an SD3Transformer2DModel.
bool is_sd3_folder(const std::filesystem::path& model);

// The pipeline for `model` (a diffusers folder or a single-file checkpoint), chosen from its
// model_index.json or, for a .safetensors file, its tensor names: Flux for FluxPipeline folders and
// FLUX.1 single files (double_blocks), StableDiffusion3 for SD3 folders and SD3 / SD3.5 single files
// (an MMDiT's joint_blocks), StableDiffusion otherwise. `config_dir`: the single-file config folder
// (any family). `drop_t5`: an SD3 model's T5 encoder is not loaded; `t5_placement`: a Flux model's
// T5 placement (job::GenerationRequest::t5_placement). Each is ignored by the other families.
std::unique_ptr<Pipeline> load_pipeline(const std::filesystem::path& model, const std::string& device,
                                        const std::filesystem::path& config_dir = {}, bool drop_t5 = false,
                                        const std::string& t5_placement = {});

}  // namespace diffract::pipeline
