#include "core/io/json_file.h"

#include <fstream>

namespace diffract::io {

JsonFile JsonFile::read(const std::filesystem::path& path) {
  if (!std::filesystem::exists(path)) throw Error(path.string() + ": missing");
  std::ifstream in(path);
  if (!in) throw Error(path.string() + ": cannot open");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(path.string() + ": malformed JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(path.string() + ": expected a JSON object");
  return JsonFile(path, std::move(j));
}

}  // namespace diffract::io
