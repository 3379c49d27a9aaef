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

}  // namespace diffract
