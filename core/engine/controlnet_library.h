#pragma once
// Where ControlNets are found: diffusers ControlNetModel folders (config.json + weights) and
// single files (diffusers' or lllyasviel's layout) under the ControlNet folders the user keeps,
// and ControlNet snapshots in the Hugging Face cache. No torch headers: the GUI lists these.
#include <filesystem>
#include <string>
#include <vector>

namespace diffract::engine {

struct ControlNetInfo {
  std::filesystem::path path;  // the folder, or the single file
  std::string name;            // the folder's name, or "org/name" for a Hugging Face snapshot
  std::string base;            // "SD 1.x", "SD 2.x", "SDXL" from its config; "" when it does not say
};

// What `dir`'s config.json says of a ControlNet folder; an empty path when the folder is not a
// ControlNetModel (no config, another class, unreadable JSON).
ControlNetInfo read_controlnet_info(const std::filesystem::path& dir);

// A ControlNet saved as one file: a .safetensors whose header names controlnet_cond_embedding.*
// (diffusers) or input_hint_block.* (lllyasviel's, bare or under control_model.), its base from
// the shapes; a .pth / .ckpt as it is (a pickle is read when used). An empty path for any other file.
ControlNetInfo read_controlnet_file_info(const std::filesystem::path& file);

// The ControlNet folders and single files under each of `dirs` (the folder itself or below it,
// three levels at most, in path order), then the newest snapshot of each ControlNet repository in `hub` (empty:
// none).
std::vector<ControlNetInfo> find_controlnets(const std::vector<std::string>& dirs, const std::filesystem::path& hub);

}  // namespace diffract::engine
