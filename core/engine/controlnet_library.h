#pragma once
// Where ControlNets are found: diffusers ControlNetModel folders (config.json + weights) under the
// ControlNet folders the user keeps, and ControlNet snapshots in the Hugging Face cache. No torch
// headers: the GUI lists these.
#include <filesystem>
#include <string>
#include <vector>

namespace diffract::engine {

struct ControlNetInfo {
  std::filesystem::path path;  // the folder
  std::string name;            // the folder's name, or "org/name" for a Hugging Face snapshot
  std::string base;            // "SD 1.x", "SD 2.x", "SDXL" from its config; "" when it does not say
};

// What `dir`'s config.json says of a ControlNet folder; an empty path when the folder is not a
// ControlNetModel (no config, another class, unreadable JSON).
ControlNetInfo read_controlnet_info(const std::filesystem::path& dir);

// The ControlNet folders under each of `dirs` (the folder itself or below it, three levels at
// most, in name order), then the newest snapshot of each ControlNet repository in `hub` (empty:
// none).
std::vector<ControlNetInfo> find_controlnets(const std::vector<std::string>& dirs, const std::filesystem::path& hub);

}  // namespace diffract::engine
