#include "core/engine/controlnet_library.h"

#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/engine/model_discovery.h"
#include "core/io/safetensors.h"

namespace diffract::engine {

namespace fs = std::filesystem;

ControlNetInfo read_controlnet_info(const fs::path& dir) {
  std::error_code ec;
  const auto config = dir / "config.json";
  if (!fs::is_regular_file(config, ec)) return {};
  std::ifstream in(config, std::ios::binary);
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || j.value("_class_name", std::string()) != "ControlNetModel") return {};
  ControlNetInfo info;
  info.path = dir;
  info.name = dir.filename().string();
  if (j.value("addition_embed_type", nlohmann::json()).is_string()) {
    info.base = "SDXL";
  } else if (const auto& c = j.value("cross_attention_dim", nlohmann::json()); c.is_number_integer()) {
    info.base = c.get<int>() == 768 ? "SD 1.x" : c.get<int>() == 1024 ? "SD 2.x" : "";
  }
  return info;
}

ControlNetInfo read_controlnet_file_info(const fs::path& file) {
  try {
    const auto archive = io::SafetensorsArchive::open(file);
    if (!archive->find("controlnet_cond_embedding.conv_in.weight")) return {};
    ControlNetInfo info;
    info.path = file;
    info.name = file.filename().string();
    if (archive->find("add_embedding.linear_1.weight")) info.base = "SDXL";
    return info;
  } catch (const std::exception&) {
    return {};  // not a safetensors file we can read: not listed
  }
}

std::vector<ControlNetInfo> find_controlnets(const std::vector<std::string>& dirs, const fs::path& hub) {
  std::vector<ControlNetInfo> out;
  std::error_code ec;
  for (const auto& d : dirs) {
    if (!fs::is_directory(d, ec)) continue;
    std::vector<ControlNetInfo> here;
    if (auto info = read_controlnet_info(d); !info.path.empty()) here.push_back(info);
    for (auto it = fs::recursive_directory_iterator(d, fs::directory_options::skip_permission_denied, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (!it->is_directory(ec)) {
        if (it->path().extension() == ".safetensors" && it->path().filename() != "diffusion_pytorch_model.safetensors")
          if (auto info = read_controlnet_file_info(it->path()); !info.path.empty()) here.push_back(info);
        continue;
      }
      if (auto info = read_controlnet_info(it->path()); !info.path.empty()) {
        here.push_back(info);
        it.disable_recursion_pending();  // a model's own subfolders hold no other model
      } else if (it.depth() >= 2) {
        it.disable_recursion_pending();
      }
    }
    std::sort(here.begin(), here.end(), [](const ControlNetInfo& a, const ControlNetInfo& b) { return a.path < b.path; });
    out.insert(out.end(), here.begin(), here.end());
  }
  if (!hub.empty() && fs::is_directory(hub, ec)) {
    std::vector<ControlNetInfo> here;
    for (const auto& repo : fs::directory_iterator(hub, ec)) {
      const auto snapshots = repo.path() / "snapshots";
      if (!fs::is_directory(snapshots, ec)) continue;
      fs::path newest;
      fs::file_time_type when{};
      for (const auto& snap : fs::directory_iterator(snapshots, ec)) {
        const auto t = fs::last_write_time(snap.path(), ec);
        if (newest.empty() || t > when) {
          newest = snap.path();
          when = t;
        }
      }
      if (newest.empty()) continue;
      if (auto info = read_controlnet_info(newest); !info.path.empty()) {
        if (const auto repo_name = hugging_face_repo_name(newest); !repo_name.empty()) info.name = repo_name;
        here.push_back(info);
      }
    }
    std::sort(here.begin(), here.end(), [](const ControlNetInfo& a, const ControlNetInfo& b) { return a.name < b.name; });
    out.insert(out.end(), here.begin(), here.end());
  }
  return out;
}

}  // namespace diffract::engine
