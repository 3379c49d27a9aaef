#include "core/io/json_fields.h"

#include "core/io/json_file.h"
#include "core/util/error.h"

namespace diffract::io {

using nlohmann::json;

JsonFields::JsonFields(const json& object, std::string where) : json_(object), where_(std::move(where)) {
  if (!json_.is_object()) throw Error(where_ + " must be a JSON object, not " + json_brief(json_));
}

void JsonFields::only(const std::set<std::string>& known) const {
  for (const auto& [key, value] : json_.items())
    if (!known.count(key)) {
      std::string names;
      for (const auto& k : known) names += (names.empty() ? "" : ", ") + k;
      throw Error(where_ + ": unknown field " + json_brief(json(key)) + " (known: " + names + ")");
    }
}

std::string JsonFields::text(const std::string& key, bool required, std::string fallback) const {
  if (!json_.contains(key)) {
    if (required) throw Error(where_ + ": missing field '" + key + "'");
    return fallback;
  }
  if (!json_[key].is_string()) throw Error(field(key) + " must be a string, not " + json_brief(json_[key]));
  return json_[key].get<std::string>();
}

int JsonFields::integer(const std::string& key, bool required, int fallback) const {
  if (!json_.contains(key)) {
    if (required) throw Error(where_ + ": missing field '" + key + "'");
    return fallback;
  }
  const auto& v = json_[key];
  const bool in_range = v.is_number_unsigned() ? v.get<std::uint64_t>() <= (1ULL << 30)
                        : v.is_number_integer() && v.get<std::int64_t>() >= -(1LL << 30);
  if (!in_range) throw Error(field(key) + " must be a whole number of at most 2^30, not " + json_brief(v));
  return v.get<int>();
}

double JsonFields::number(const std::string& key, bool required, double fallback) const {
  if (!json_.contains(key)) {
    if (required) throw Error(where_ + ": missing field '" + key + "'");
    return fallback;
  }
  if (!json_[key].is_number()) throw Error(field(key) + " must be a number, not " + json_brief(json_[key]));
  return json_[key].get<double>();
}

const json& JsonFields::list(const std::string& key) const {
  static const json empty = json::array();
  if (!json_.contains(key)) return empty;
  if (!json_[key].is_array()) throw Error(field(key) + " must be a list, not " + json_brief(json_[key]));
  return json_[key];
}

}  // namespace diffract::io
