#pragma once
// Generation presets: JSON files holding a prompt template and settings. No torch headers: the
// GUI and the CLI include this.
#include <filesystem>
#include <string>
#include <vector>

#include "core/job/request.h"

namespace diffract::engine {

// One preset file:
//   {"name": "Studio packshot on white", "description": "...",
//    "prompt_template": "studio photograph of {subject} on a white background",
//    "negative_prompt": "...", "width": 1024, "height": 1024, "steps": 30,
//    "sampler": "dpmpp-2m-karras", "cfg": 6.5, "strategy": "single", "devices": 1}
// Every occurrence of {subject} in prompt_template is replaced by the user's prompt; the
// template must hold at least one. width / height 0 mean the model's native size, an empty
// sampler the model's own; description, guidance (Flux.1-dev; default 3.5), devices (default 1), skip (step-skip, deepcache; default 2), cache_threshold (fbcache, teacache; default the strategy's) and precision (bf16 or fp8) are
// optional. Files that gave step-skip's skip factor as "devices" still read as before. Unknown
// keys are errors, so a misspelt field is not silently ignored.
// Optional adapters:
//   "loras": [{"name": "brand-style", "weight": 0.8, "text_encoder_weight": 0.8}]
//     by name (a file stem in the LoRA folders, as <lora:NAME> tags name them);
//   "controlnets": [{"model": "/models/controlnet-canny-sdxl", "preprocessor": "canny",
//     "low": 100, "high": 200, "scale": 0.7, "start": 0, "end": 1}]
//     the model, how the GUI makes the control image (none / canny) and when it acts; the
//     control image itself belongs to each job.
struct Preset {
  std::string name;
  std::string description;
  std::string prompt_template = "{subject}";
  std::string negative_prompt;
  int width = 0;
  int height = 0;
  int steps = 30;
  std::string sampler;
  double cfg = 7.0;
  double guidance = 3.5;  // Flux.1-dev's distilled guidance (optional in the file)
  std::string strategy = "single";
  int devices = 1;
  int skip = 2;  // step-skip's skip factor
  double cache_threshold = -1;  // fbcache's, teacache's threshold (optional in the file; negative: the strategy's default)
  std::string precision;  // "bf16" or "fp8" (optional in the file; empty: bf16)
  struct Lora {
    std::string name;
    double weight = 1.0, text_encoder_weight = 1.0;
  };
  std::vector<Lora> loras;
  struct ControlNet {
    std::string model;                 // a ControlNet folder or file
    std::string preprocessor = "none";  // "none" (the image as given) or "canny"
    int low = 100, high = 200;          // canny's hysteresis thresholds
    double scale = 1.0, start = 0.0, end = 1.0;
  };
  std::vector<ControlNet> controlnets;
};

inline const std::vector<std::string>& control_preprocessors() {
  static const std::vector<std::string> names = {"none", "canny"};
  return names;
}

inline constexpr const char* kSubjectPlaceholder = "{subject}";

// Parses and validates preset JSON text; errors start with `where` (the file) and name the field.
Preset parse_preset(const std::string& json_text, const std::string& where);
Preset load_preset(const std::filesystem::path& file);
// Validates, then writes pretty-printed JSON (creating the folder); parse_preset reads it back.
void save_preset(const Preset& preset, const std::filesystem::path& file);
std::string preset_to_json(const Preset& preset);
// Throws an error starting with `where` for a field no job could run with.
void validate_preset(const Preset& preset, const std::string& where);

// The template with each {subject} replaced by `subject`.
std::string fill_prompt_template(const std::string& prompt_template, const std::string& subject);
// Fills the request's prompt (from `subject`), negative prompt, size, steps, sampler, CFG and
// strategy, and adds the preset's LoRAs by name (LoraRef with an empty path: resolve_lora_tags
// finds them). ControlNets need a control image: the caller pairs them with one.
void apply_preset(const Preset& preset, const std::string& subject, job::GenerationRequest& request);
// The reverse: a preset called `name` with `prompt_template` and the request's negative prompt,
// size, steps, sampler, CFG, strategy and LoRAs (by name). A strategy that takes a skip factor (step-skip) keeps
// request.strategy.skip and one device; any other keeps request.strategy.devices and the
// default skip. apply_preset of the result gives those fields back.
Preset preset_from_request(const std::string& name, const std::string& prompt_template,
                           const job::GenerationRequest& request);
// A file name for a preset called `name`: lower case, runs of other characters as "-", ".json".
std::string preset_file_name(const std::string& name);

// `name_or_file`: a path to a .json file, or a preset's file stem or name (case-insensitive)
// in one of `dirs`, searched in order. The error lists what the folders hold.
Preset find_preset(const std::string& name_or_file, const std::vector<std::filesystem::path>& dirs);

}  // namespace diffract::engine
