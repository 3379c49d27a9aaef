#pragma once
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "core/util/error.h"

namespace diffract::io {

// A JSON object read from a file, whose accessors throw errors naming the file and the key.
class JsonFile {
 public:
  static JsonFile read(const std::filesystem::path& path);
  JsonFile(std::filesystem::path path, nlohmann::json json) : path_(std::move(path)), json_(std::move(json)) {}

  const std::filesystem::path& path() const { return path_; }
  const nlohmann::json& json() const { return json_; }
  bool has(const std::string& key) const { return json_.contains(key) && !json_[key].is_null(); }

  template <typename T>
  T required(const std::string& key) const {
    if (!has(key)) throw Error(path_.string() + ": missing key '" + key + "'");
    return get<T>(key);
  }
  template <typename T>
  T optional(const std::string& key, T fallback) const {
    return has(key) ? get<T>(key) : fallback;
  }

 private:
  template <typename T>
  T get(const std::string& key) const {
    try {
      return json_.at(key).get<T>();
    } catch (const nlohmann::json::exception&) {
      throw Error(path_.string() + ": key '" + key + "' has the wrong type (" + json_.at(key).dump() + ")");
    }
  }

  std::filesystem::path path_;
  nlohmann::json json_;
};

}  // namespace diffract::io
