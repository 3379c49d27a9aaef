#pragma once
// Typed fields of an untrusted JSON object (a preset, a lanes file), each error naming the file
// and the field and showing the bad value by kind and size only (json_brief).
#include <initializer_list>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

namespace diffract::io {

class JsonFields {
 public:
  // `where`: the file (or "file: lanes entry 2"), the start of every error.
  JsonFields(const nlohmann::json& object, std::string where);

  // Throws naming the first key not in `known` (and listing them).
  void only(const std::set<std::string>& known) const;
  bool has(const std::string& key) const { return json_.contains(key); }

  std::string text(const std::string& key, bool required, std::string fallback = {}) const;
  // Whole numbers within ±2^30 only (no 2^64 - 1 read as -1, no 1e30 truncated).
  int integer(const std::string& key, bool required, int fallback) const;
  double number(const std::string& key, bool required, double fallback) const;
  // A list, or an empty one when the key is absent.
  const nlohmann::json& list(const std::string& key) const;

  // "<where>: field '<key>'", for the caller's own checks.
  std::string field(const std::string& key) const { return where_ + ": field '" + key + "'"; }
  const std::string& where() const { return where_; }

 private:
  const nlohmann::json& json_;
  std::string where_;
};

}  // namespace diffract::io
