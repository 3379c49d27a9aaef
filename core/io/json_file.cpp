#include "core/io/json_file.h"

#include "core/io/read_file.h"

#include <set>
#include <vector>

namespace diffract::io {

namespace fs = std::filesystem;
using nlohmann::json;

nlohmann::json parse_json(std::string_view text, const std::string& what, const JsonLimits& limits) {
  std::vector<std::set<std::string>> keys;  // per open object, when unique_keys
  const json::parser_callback_t check = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth > limits.max_depth)
      throw Error(what + ": JSON nested deeper than " + std::to_string(limits.max_depth) + " levels");
    if (!limits.unique_keys) return true;
    if (event == json::parse_event_t::object_start) keys.emplace_back();
    else if (event == json::parse_event_t::object_end && !keys.empty()) keys.pop_back();
    else if (event == json::parse_event_t::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second)
      throw Error(what + ": the key " + json_brief(parsed) + " appears twice in one object");
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), check);
  } catch (const json::exception& e) {
    // parse_error (syntax), out_of_range (a number such as 1e400): nlohmann's text names the
    // byte offset, which is what a user needs to find it.
    std::string why = e.what();
    if (const auto p = why.find("] "); why.rfind("[json.exception.", 0) == 0 && p != std::string::npos) why = why.substr(p + 2);
    throw Error(what + ": malformed JSON: " + why);
  }
}

nlohmann::json read_json(const fs::path& path, const JsonLimits& limits, std::size_t max_bytes) {
  return parse_json(read_file(path, max_bytes), path.string(), limits);
}

std::string json_brief(const nlohmann::json& v, std::size_t max_chars) {
  switch (v.type()) {
    case json::value_t::array: return "an array of " + std::to_string(v.size());
    case json::value_t::object: return "an object of " + std::to_string(v.size()) + " keys";
    case json::value_t::binary: return "binary data";
    case json::value_t::discarded: return "nothing";
    case json::value_t::string: {
      const auto& s = v.get_ref<const std::string&>();
      if (s.size() <= max_chars) return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
      return json(s.substr(0, max_chars)).dump(-1, ' ', false, json::error_handler_t::replace) + " (" +
             std::to_string(s.size()) + " characters)";
    }
    default: return v.dump();  // a scalar
  }
}

JsonFile JsonFile::read(const fs::path& path) {
  auto j = read_json(path);
  if (!j.is_object()) throw Error(path.string() + ": expected a JSON object");
  return JsonFile(path, std::move(j));
}

}  // namespace diffract::io
