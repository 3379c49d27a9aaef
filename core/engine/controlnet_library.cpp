#include "core/engine/controlnet_library.h"

#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/engine/model_discovery.h"
#include "core/io/json_file.h"
#include "core/io/safetensors.h"

namespace diffract::engine {

namespace fs = std::filesystem;

ControlNetInfo read_controlnet_info(const fs::path& dir) {
  std::error_code ec;
  const auto config = dir / "config.json";
  if (!fs::is_regular_file(config, ec)) return {};
  nlohmann::json j;
  try {
    j = io::read_json(config);
  } catch (const Error&) {
    return {};  // unreadable (or a FIFO, a folder): not listed
  }
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
  ControlNetInfo info;
  info.path = file;
  info.name = file.filename().string();
  const auto ext = file.extension().string();
  if (ext == ".pth" || ext == ".ckpt") return info;  // a pickle: read when used, not to list it
  try {
    const auto archive = io::SafetensorsArchive::open(file);
    const bool diffusers = archive->find("controlnet_cond_embedding.conv_in.weight");
    const std::string ldm = archive->find("control_model.input_hint_block.0.weight") ? "control_model." : "";
    if (!diffusers && !archive->find(ldm + "input_hint_block.0.weight")) return {};
    if (archive->find(diffusers ? "add_embedding.linear_1.weight" : ldm + "label_emb.0.0.weight")) {
      info.base = "SDXL";
      return info;
    }
    for (const auto& t : archive->tensors()) {  // the cross-attention's context width
      const auto& n = t.name;
      if ((diffusers || n.rfind(ldm, 0) == 0) && n.size() > 17 && n.compare(n.size() - 17, 17, "attn2.to_k.weight") == 0 &&
          t.shape.size() == 2) {
        info.base = t.shape[1] == 768 ? "SD 1.x" : t.shape[1] == 1024 ? "SD 2.x" : "";
        break;
      }
    }
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
        const auto ext = it->path().extension();
        if ((ext == ".safetensors" || ext == ".pth" || ext == ".ckpt") &&
            it->path().stem() != "diffusion_pytorch_model")
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
