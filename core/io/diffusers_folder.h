#pragma once
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace diffract::io {

// One entry of model_index.json and what was found for it on disk.
struct Component {
  enum class Kind { Model, Scheduler, Tokenizer, Other };
  std::string name;        // "unet", "text_encoder_2", ...
  std::string library;     // "diffusers", "transformers"
  std::string class_name;  // "UNet2DConditionModel", "CLIPTokenizer", ...
  Kind kind = Kind::Other;
  std::filesystem::path dir;
  bool present = false;
  std::string problem;                   // why it is not usable, when !present
  std::filesystem::path config;          // config.json / scheduler_config.json / tokenizer_config.json
  std::filesystem::path weights;         // models: the chosen weight file (or shard index)
  std::string variant;                   // "fp16" when a variant file was chosen
};

// A diffusers pipeline folder: model_index.json plus one sub-folder per component.
class DiffusersFolder {
 public:
  // Reads model_index.json and inspects every component. `variant` ("fp16") prefers
  // `*.fp16.safetensors` weights; without one, the plain files are preferred and a variant
  // is taken only when it is all there is.
  static DiffusersFolder open(const std::filesystem::path& root, const std::string& variant = "");

  const std::filesystem::path& root() const { return root_; }
  const std::string& pipeline_class() const { return pipeline_class_; }
  const std::vector<Component>& components() const { return components_; }
  const Component* find(const std::string& name) const;
  // The component, which must be listed and present; otherwise an error naming the folder.
  const Component& require(const std::string& name) const;
  // One line per component: name, class, present or the problem, weight file.
  std::string summary() const;

 private:
  std::filesystem::path root_;
  std::string pipeline_class_;
  std::vector<Component> components_;
};

// The weight file of a model folder (config.json + weights), following diffusers' and
// transformers' naming: diffusion_pytorch_model / model, .safetensors before .bin,
// shard indexes, and `variant`. Empty when none is there.
std::optional<std::filesystem::path> find_weights(const std::filesystem::path& dir, const std::string& variant,
                                                  std::string* chosen_variant = nullptr);
// find_weights, or an error naming the folder and the file names looked for.
std::filesystem::path require_weights(const std::filesystem::path& dir, const std::string& variant);

}  // namespace diffract::io
