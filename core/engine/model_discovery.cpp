#include "core/engine/model_discovery.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <map>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/io/json_file.h"
#include "core/io/safetensors.h"
#include "core/io/single_file.h"
#include "core/util/error.h"
#include "core/util/environment.h"

namespace fs = std::filesystem;

namespace diffract::engine {

namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// The folders inside `dir` (hidden ones left out, as a file manager would), newest first; a
// folder that cannot be read has none.
std::vector<fs::path> subfolders_newest_first(const fs::path& dir) {
  std::vector<std::pair<fs::file_time_type, fs::path>> found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    if (name.empty() || name[0] == '.' || !it->is_directory(ec)) continue;
    found.emplace_back(fs::last_write_time(it->path(), ec), it->path());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

bool present(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

}  // namespace

fs::path hugging_face_hub() {
  if (auto hub = options::environment("HF_HUB_CACHE"); !hub.empty()) return hub;
  if (auto home = options::environment("HF_HOME"); !home.empty()) return fs::path(home) / "hub";
  return fs::path(options::environment("HOME")) / ".cache" / "huggingface" / "hub";
}

std::vector<fs::path> discover_hugging_face_models(const fs::path& hub) {
  std::vector<fs::path> repos;
  std::error_code ec;
  for (fs::directory_iterator it(hub, ec), end; !ec && it != end; it.increment(ec))
    if (starts_with(it->path().filename().string(), "models--") && it->is_directory(ec)) repos.push_back(it->path());
  std::sort(repos.begin(), repos.end());
  std::vector<fs::path> models;
  for (const auto& repo : repos)
    for (const auto& snap : subfolders_newest_first(repo / "snapshots"))
      if (present(snap / "model_index.json")) {
        models.push_back(snap);
        break;
      }
  return models;
}

std::string hugging_face_repo_name(const fs::path& snapshot) {
  const fs::path clean = snapshot.lexically_normal();
  const fs::path dir = clean.has_filename() ? clean : clean.parent_path();
  const std::string repo = dir.parent_path().parent_path().filename().string();
  if (dir.parent_path().filename() != "snapshots" || !starts_with(repo, "models--")) return {};
  std::string out = repo.substr(8);
  for (std::size_t at = out.find("--"); at != std::string::npos; at = out.find("--", at + 1)) out.replace(at, 2, "/");
  return out;
}

std::string guess_model_family(const fs::path& model) {
  std::error_code ec;
  if (fs::is_regular_file(model, ec)) {
    try {
      const auto shapes = io::tensor_shapes(*io::SafetensorsArchive::open(model));
      if (io::is_flux_single_file(shapes)) return "Flux";
      if (io::is_sd3_single_file(shapes)) return "SD3";
      return io::detect_single_file(shapes, model.string()).family == io::SingleFileFamily::SDXL ? "SDXL" : "SD";
    } catch (const Error&) {
      return {};
    }
  }
  nlohmann::json index;
  try {
    index = io::read_json(model / "model_index.json");
  } catch (const Error&) {
    return {};
  }
  std::string pipeline;
  if (index.is_object() && index.contains("_class_name") && index["_class_name"].is_string())
    pipeline = index["_class_name"].get<std::string>();
  return starts_with(pipeline, "StableDiffusionXL")  ? "SDXL"
         : starts_with(pipeline, "StableDiffusion3") ? "SD3"
         : starts_with(pipeline, "Flux")             ? "Flux"
         : starts_with(pipeline, "StableDiffusion")  ? "SD"
                                                     : "";
}

std::optional<int> guess_native_size(const fs::path& model) { return guess_native_size(model, guess_model_family(model)); }

std::optional<int> guess_native_size(const fs::path& model, const std::string& family) {
  std::error_code ec;
  if (family.empty()) return std::nullopt;
  if (fs::is_regular_file(model, ec) || family == "Flux") return family == "SD" ? 512 : 1024;
  try {
    const auto denoiser = io::read_json(model / (family == "SD3" ? "transformer" : "unet") / "config.json");
    const auto vae = io::read_json(model / "vae" / "config.json");
    if (!denoiser.is_object() || !denoiser.contains("sample_size") || !denoiser["sample_size"].is_number_integer())
      return std::nullopt;
    // AutoencoderKL's block_out_channels, AutoencoderTiny's encoder_block_out_channels: a block
    // each, each but the last halving.
    int factor = 8;
    for (const char* key : {"block_out_channels", "encoder_block_out_channels"})
      if (vae.is_object() && vae.contains(key) && vae[key].is_array() && !vae[key].empty() && vae[key].size() <= 8)
        factor = 1 << (vae[key].size() - 1);
    const auto size = denoiser["sample_size"].get<long long>() * factor;
    if (size < 8 || size > 16384) return std::nullopt;
    return static_cast<int>(size);
  } catch (const Error&) {
    return std::nullopt;
  }
}

std::uint64_t model_weight_bytes(const fs::path& model) {
  std::error_code ec;
  if (fs::is_regular_file(model, ec)) {
    const auto size = fs::file_size(model, ec);
    return ec ? 0 : size;
  }
  // Per folder: the plain weight files, or its variants when it has only those.
  std::map<fs::path, std::pair<std::uint64_t, std::uint64_t>> per_folder;  // plain, variant
  auto it = fs::recursive_directory_iterator(model, fs::directory_options::follow_directory_symlink |
                                                        fs::directory_options::skip_permission_denied, ec);
  for (int seen = 0; !ec && it != fs::recursive_directory_iterator() && seen < 10000; it.increment(ec), ++seen) {
    if (it.depth() > 2) it.disable_recursion_pending();  // a diffusers folder is two deep; links may loop
    const auto& path = it->path();
    const auto ext = path.extension().string();
    if ((ext != ".safetensors" && ext != ".bin" && ext != ".pth" && ext != ".ckpt") || !it->is_regular_file(ec)) continue;
    const auto size = it->file_size(ec);
    if (ec) return 0;
    const auto name = path.filename().string();
    const bool variant = name.find(".fp16.") != std::string::npos || name.find(".bf16.") != std::string::npos;
    auto& [plain, variants] = per_folder[path.parent_path()];
    (variant ? variants : plain) += size;
  }
  if (ec) return 0;
  std::uint64_t total = 0;
  for (const auto& [folder, sizes] : per_folder) total += sizes.first > 0 ? sizes.first : sizes.second;
  return total;
}

fs::path matching_taesd(const fs::path& model, const fs::path& hub) {
  // madebyollin's repositories, by the family's latent space.
  const std::string family = guess_model_family(model);
  const std::string repo = family == "SDXL" ? "taesdxl" : family == "SD3" ? "taesd3" : family == "Flux" ? "taef1"
                           : family == "SD" ? "taesd" : "";
  if (repo.empty()) return {};
  // A diffusers AutoencoderTiny snapshot (config.json), or the original files (<name>_decoder.pth).
  for (const auto& snap : subfolders_newest_first(hub / ("models--madebyollin--" + repo) / "snapshots"))
    if (present(snap / "config.json") || present(snap / (repo + "_decoder.pth")) ||
        present(snap / (repo + "_decoder.safetensors")))
      return snap;
  return {};
}

}  // namespace diffract::engine
