#include "core/pipeline/factory.h"

#include <optional>

#include "core/io/json_file.h"
#include "core/pipeline/flux.h"
#include "core/pipeline/single_file.h"
#include "core/pipeline/stable_diffusion.h"
#include "core/pipeline/stable_diffusion_3.h"

namespace diffract::pipeline {

namespace fs = std::filesystem;

namespace {

// A diffusers folder's model_index.json, or nothing for anything else (a single file).
std::optional<io::JsonFile> model_index(const fs::path& model) {
  std::error_code ec;
  const auto index_path = model / "model_index.json";
  if (!fs::is_directory(model, ec) || !fs::is_regular_file(index_path, ec)) return std::nullopt;
  return io::JsonFile::read(index_path);
}

bool is_sd3_index(const io::JsonFile& index) {
  const auto cls = index.optional<std::string>("_class_name", "");
  if (cls.rfind("StableDiffusion3", 0) == 0) return true;
  const auto& j = index.json();
  const auto it = j.find("transformer");
  return it != j.end() && it->is_array() && it->size() == 2 && (*it)[1].is_string() &&
         (*it)[1].get<std::string>() == "SD3Transformer2DModel";
}

// A folder of a pipeline these loaders do not run is refused by its class name before anything
// is read as an SD UNet.
void check_pipeline_class(const io::JsonFile& index) {
  const auto cls = index.optional<std::string>("_class_name", "");
  const bool sd = cls.rfind("StableDiffusion", 0) == 0 && cls.find("Upscale") == std::string::npos &&
                  cls.find("Video") == std::string::npos && cls.find("Cascade") == std::string::npos;
  if (cls.empty() || sd || cls == "FluxPipeline") return;
  throw Error(index.path().string() + ": a " + io::json_brief(nlohmann::json(cls)) +
              ", which Diffract does not run (it runs StableDiffusion, StableDiffusionXL, StableDiffusion3 and Flux pipelines)");
}

}  // namespace

bool is_sd3_folder(const fs::path& model) {
  const auto index = model_index(model);
  return index && is_sd3_index(*index);
}

std::unique_ptr<Pipeline> load_pipeline(const fs::path& model, const std::string& device, const fs::path& config_dir,
                                        bool drop_t5, const std::string& t5_placement) {
  const auto index = model_index(model);
  if (index) check_pipeline_class(*index);
  if (index ? index->optional<std::string>("_class_name", "") == "FluxPipeline" : is_flux_single_file(model)) {
    Flux::LoadOptions options;
    options.config_dir = config_dir;
    options.t5_placement = t5_placement;
    return Flux::load(model, device, options);
  }
  if (index ? is_sd3_index(*index) : is_sd3_single_file(model)) {
    StableDiffusion3::LoadOptions options;
    options.drop_t5 = drop_t5;
    options.config_dir = config_dir;
    return StableDiffusion3::load(model, device, options);
  }
  return StableDiffusion::load(model, device, config_dir);
}

}  // namespace diffract::pipeline
