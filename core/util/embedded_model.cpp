#include "core/util/embedded_model.h"

#include <system_error>
#include <vector>

#include "core/util/options.h"

namespace diffract {

std::filesystem::path embedded_model_dir() {
  namespace fs = std::filesystem;
  std::vector<fs::path> candidates;
  std::error_code ec;
  if (options::is_set(options::Id::EmbeddedModel)) {
    candidates.emplace_back(options::value(options::Id::EmbeddedModel));  // alone: tests pin it (or point it nowhere)
  } else {
    const auto exe = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) candidates.push_back(exe.parent_path() / ".." / "share" / "diffract" / "models" / "diffract-emoji");
    candidates.push_back(fs::path(DIFFRACT_SOURCE_DIR) / "resources" / "models" / "diffract-emoji");
  }
  for (const auto& c : candidates)
    if (fs::is_regular_file(c / "model_index.json", ec)) return fs::weakly_canonical(c, ec);
  return {};
}

std::filesystem::path embedded_inpainting_model_dir() {
  const auto model = embedded_model_dir();
  if (model.empty()) return {};
  const auto dir = model.parent_path() / (model.filename().string() + "-inpaint");
  std::error_code ec;
  return std::filesystem::is_regular_file(dir / "model_index.json", ec) ? dir : std::filesystem::path();
}

std::filesystem::path embedded_lora_dir() {
  const auto model = embedded_model_dir();
  if (model.empty()) return {};
  const auto dir = model.parent_path() / "loras";
  std::error_code ec;
  return std::filesystem::is_directory(dir, ec) ? dir : std::filesystem::path();
}

}  // namespace diffract
