#pragma once
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/util/error.h"

namespace diffract::io {

// What a JSON document from a file or a user may be. The parser itself does not recurse, but
// dump(), comparisons and copies do: a document nested deeper than `max_depth` is an error at
// parse time, before anything walks it.
struct JsonLimits {
  int max_depth = 64;
  bool unique_keys = false;  // a key twice in one object is an error (else the last one wins)
};

// Parses untrusted JSON text; every failure (syntax, nesting, a number out of range, a duplicate
// key under `limits`) is an Error naming `what`.
nlohmann::json parse_json(std::string_view text, const std::string& what, const JsonLimits& limits = {});

// The file's contents parsed as above (read_file.h: a missing file, a folder or a FIFO is an
// Error naming it, nothing blocks; larger than `max_bytes` is refused).
nlohmann::json read_json(const std::filesystem::path& path, const JsonLimits& limits = {},
                         std::size_t max_bytes = std::size_t(256) << 20);

// An untrusted value as an error message may show it: numbers, booleans and null as they are,
// strings quoted and cut to `max_chars`, arrays and objects by their size ("an array of 3").
// Never recursive.
std::string json_brief(const nlohmann::json& v, std::size_t max_chars = 60);

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
  struct is_vector : std::false_type {};
  template <typename U>
  struct is_vector<std::vector<U>> : std::true_type {};

  template <typename T>
  T get(const std::string& key) const {
    const auto& v = json_.at(key);
    if constexpr (is_vector<T>::value) {  // each element as a value of its own
      if (!v.is_array())
        throw Error(path_.string() + ": key '" + key + "' must be a list, not " + json_brief(v));
      T out;
      for (const auto& x : v) out.push_back(convert<typename T::value_type>(x, key, " (each entry)"));
      return out;
    } else {
      return convert<T>(v, key, "");
    }
  }
  // nlohmann converts between number kinds silently (-1 to 2^64 - 1, 1e30 to whatever the
  // float-to-int conversion gives): only values the type holds exactly are taken.
  template <typename T>
  T convert(const nlohmann::json& v, const std::string& key, const char* entry) const {
    const auto wrong_type = [&](const std::string& want) {
      return Error(path_.string() + ": key '" + key + "' must be " + want + entry + ", not " + json_brief(v));
    };
    if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) throw wrong_type("true or false");
    } else if constexpr (std::is_integral_v<T>) {
      const std::string range = "a whole number from " + std::to_string(std::numeric_limits<T>::min()) + " to " +
                                std::to_string(std::numeric_limits<T>::max());
      if (v.is_number_float()) {  // 4.0 for 4
        const double d = v.get<double>();
        if (d != std::trunc(d) || d < static_cast<double>(std::numeric_limits<T>::min()) ||
            !(d < static_cast<double>(std::numeric_limits<T>::max()) + 1.0))
          throw wrong_type(range);
        return static_cast<T>(d);
      }
      if (!v.is_number_integer()) throw wrong_type("a whole number");
      if (!fits<T>(v)) throw wrong_type(range);
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!v.is_number()) throw wrong_type("a number");
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (!v.is_string()) throw wrong_type("a string");
    }
    try {
      return v.template get<T>();
    } catch (const nlohmann::json::exception&) {
      throw wrong_type("another type");
    }
  }
  template <typename T>
  static bool fits(const nlohmann::json& v) {
    if (v.is_number_unsigned()) return v.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<T>::max());
    const auto i = v.get<std::int64_t>();
    if constexpr (std::is_unsigned_v<T>) return i >= 0 && static_cast<std::uint64_t>(i) <= std::numeric_limits<T>::max();
    else return i >= std::numeric_limits<T>::min() && i <= std::numeric_limits<T>::max();
  }

  std::filesystem::path path_;
  nlohmann::json json_;
};

}  // namespace diffract::io
