#include "core/pipeline/factory.h"

#include "core/io/json_file.h"
#include "core/pipeline/single_file.h"
#include "core/pipeline/stable_diffusion.h"
#include "core/pipeline/stable_diffusion_3.h"

namespace diffract::pipeline {

namespace fs = std::filesystem;

bool is_sd3_folder(const fs::path& model) {
  const auto index_path = model / "model_index.json";
  if (!fs::is_directory(model) || !fs::is_regular_file(index_path)) return false;
  const auto index = io::JsonFile::read(index_path);
  const auto cls = index.optional<std::string>("_class_name", "");
  if (cls.rfind("StableDiffusion3", 0) == 0) return true;
  const auto& j = index.json();
  const auto it = j.find("transformer");
  return it != j.end() && it->is_array() && it->size() == 2 && (*it)[1].is_string() &&
         (*it)[1].get<std::string>() == "SD3Transformer2DModel";
}

std::unique_ptr<Pipeline> load_pipeline(const fs::path& model, const std::string& device, const fs::path& config_dir,
                                        bool drop_t5) {
  if (is_sd3_folder(model) || is_sd3_single_file(model)) {
    StableDiffusion3::LoadOptions options;
    options.drop_t5 = drop_t5;
    options.config_dir = config_dir;
    return StableDiffusion3::load(model, device, options);
  }
  return StableDiffusion::load(model, device, config_dir);
}

}  // namespace diffract::pipeline
