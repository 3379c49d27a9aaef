// Untrusted JSON (configs, presets, model_index.json, tokenizer files, PNG chunks, the tuning
// store's files): the parser's limits, then what the loaders do with a parsed config (typed
// accessors, error texts) and the tuning store's checks (never a throw).
#include "core/io/json_file.h"
#include "core/io/tuning_store.h"
#include "core/util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  {
    diffract::io::TuningIdentity id;
    id.fields = {{"gpu", "NVIDIA H200"}, {"driver", "580.159.04"}};
    std::string problem;
    if (const auto tables = diffract::io::TuningStore::parse(std::string(text), id, problem))
      if (tables->is_object() && tables->size() > 1000000) return 0;
  }
  for (const bool unique : {false, true}) {
    try {
      const auto j = diffract::io::parse_json(text, "fuzz", {.max_depth = 64, .unique_keys = unique});
      std::size_t n = diffract::io::json_brief(j).size();
      if (!j.is_object()) continue;
      const diffract::io::JsonFile f("config.json", j);
      for (const auto& [key, value] : j.items()) {
        n += diffract::io::json_brief(value).size();
        try {
          n += static_cast<std::size_t>(f.optional<std::int64_t>(key, 0));
        } catch (const diffract::Error&) {
        }
        try {
          n += f.optional<std::string>(key, "").size();
        } catch (const diffract::Error&) {
        }
        try {
          n += f.optional<std::vector<std::int64_t>>(key, {}).size();
        } catch (const diffract::Error&) {
        }
        try {
          n += f.optional<bool>(key, false) ? 1 : 0;
          n += static_cast<std::size_t>(f.optional<double>(key, 0.0) != 0.0);
        } catch (const diffract::Error&) {
        }
      }
      if (n == 1) return 0;
    } catch (const diffract::Error&) {
    }
  }
  return 0;
}
