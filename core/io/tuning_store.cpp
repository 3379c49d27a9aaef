#include "core/io/tuning_store.h"

#include <cctype>
#include <cstdint>
#include <cstdio>

#include "core/io/json_file.h"
#include "core/io/read_file.h"
#include "core/util/environment.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/options.h"

namespace diffract::io {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "diffract-tuning";
// format / tables / table / key / record / a record's array: six levels are all a store needs.
const JsonLimits kLimits{8, true};

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Every table an object of objects; anything else in a table is dropped, with a count.
json valid_tables(const json& tables, std::size_t& dropped) {
  json out = json::object();
  for (const auto& [name, table] : tables.items()) {
    if (!table.is_object()) {
      ++dropped;
      continue;
    }
    json& kept = out[name] = json::object();
    for (const auto& [key, record] : table.items()) {
      if (!record.is_object() || kept.size() >= TuningStore::kMaxRecordsPerTable) {
        ++dropped;
        continue;
      }
      kept[key] = record;
    }
  }
  return out;
}

}  // namespace

std::string TuningIdentity::key() const {
  std::string k;
  for (const auto& [name, value] : fields) k += name + "=" + value + ";";
  return k;
}

std::optional<json> TuningStore::parse(const std::string& text, const TuningIdentity& identity, std::string& problem) {
  try {
    const auto j = parse_json(text, "tuning store", kLimits);
    if (!j.is_object() || !j.contains("format") || j["format"] != kFormat) {
      problem = "not a Diffract tuning store (no \"format\": \"" + std::string(kFormat) + "\")";
      return std::nullopt;
    }
    if (!j.contains("version") || !j["version"].is_number_integer() || j["version"] != kFormatVersion) {
      problem = "written by another version of Diffract (format version " +
                (j.contains("version") ? json_brief(j["version"]) : std::string("missing")) + ", this one reads " +
                std::to_string(kFormatVersion) + ")";
      return std::nullopt;
    }
    const auto& id = j.contains("identity") ? j["identity"] : json();
    if (!id.is_object()) {
      problem = "no \"identity\" object";
      return std::nullopt;
    }
    for (const auto& [name, value] : identity.fields)
      if (!id.contains(name) || !id[name].is_string() || id[name].get<std::string>() != value) {
        problem = "tuned for another " + name + " (" + (id.contains(name) ? json_brief(id[name]) : "none") +
                  ", this process has \"" + value + "\")";
        return std::nullopt;
      }
    if (!j.contains("tables") || !j["tables"].is_object()) {
      problem = "no \"tables\" object";
      return std::nullopt;
    }
    std::size_t dropped = 0;
    auto tables = valid_tables(j["tables"], dropped);
    if (dropped > 0) problem = std::to_string(dropped) + " malformed entries left out";
    return tables;
  } catch (const std::exception& e) {
    problem = e.what();
    return std::nullopt;
  }
}

TuningStore::TuningStore(fs::path file, TuningIdentity identity) : file_(std::move(file)), identity_(std::move(identity)) {
  if (file_.empty()) return;
  std::error_code ec;
  if (!fs::exists(file_, ec)) return;
  try {
    const auto text = read_file(file_, kMaxFileBytes, "tuning store");
    if (auto tables = parse(text, identity_, load_problem_)) tables_ = std::move(*tables);
  } catch (const std::exception& e) {
    load_problem_ = e.what();
  }
  if (!load_problem_.empty())
    log::get("tuning").warn(log::str(file_.string(), ": ", load_problem_, "; ",
                                     tables_.empty() ? "its choices are tuned again and the file replaced"
                                                     : "the rest is used"));
}

std::optional<json> TuningStore::find(const std::string& table, const std::string& key) const {
  std::lock_guard lock(mutex_);
  const auto t = tables_.find(table);
  if (t == tables_.end()) return std::nullopt;
  const auto r = t->find(key);
  if (r == t->end()) return std::nullopt;
  return *r;
}

void TuningStore::put(const std::string& table, const std::string& key, json record) {
  std::lock_guard lock(mutex_);
  auto& t = tables_[table];
  if (!t.is_object()) t = json::object();
  if (t.size() >= kMaxRecordsPerTable && !t.contains(key)) return;
  t[key] = std::move(record);
  dirty_ = true;
}

std::size_t TuningStore::size(const std::string& table) const {
  std::lock_guard lock(mutex_);
  const auto t = tables_.find(table);
  return t == tables_.end() ? 0 : t->size();
}

bool TuningStore::dirty() const {
  std::lock_guard lock(mutex_);
  return dirty_;
}

std::string TuningStore::load_problem() const {
  std::lock_guard lock(mutex_);
  return load_problem_;
}

std::string TuningStore::last_error() const {
  std::lock_guard lock(mutex_);
  return last_error_;
}

bool TuningStore::save() {
  std::lock_guard lock(mutex_);
  if (!dirty_ || file_.empty()) return true;
  try {
    // Another process with the same GPU may have saved since this one read the file: its records
    // stay unless this one tuned the same shape.
    json merged = json::object();
    std::error_code ec;
    if (fs::exists(file_, ec)) {
      std::string ignored;
      if (auto theirs = parse(read_file(file_, kMaxFileBytes, "tuning store"), identity_, ignored)) merged = *theirs;
    }
    for (const auto& [name, table] : tables_.items()) {
      auto& t = merged[name];
      if (!t.is_object()) t = json::object();
      for (const auto& [key, record] : table.items())
        if (t.size() < kMaxRecordsPerTable || t.contains(key)) t[key] = record;
    }
    json id = json::object();
    for (const auto& [name, value] : identity_.fields) id[name] = value;
    const json doc = {{"format", kFormat}, {"version", kFormatVersion}, {"identity", id}, {"tables", merged}};
    write_file_atomically(file_, doc.dump(1), "tuning store");
    tables_ = std::move(merged);
    dirty_ = false;
    last_error_.clear();
    return true;
  } catch (const std::exception& e) {
    last_error_ = e.what();
    log::get("tuning").warn(log::str("tuning choices not saved: ", last_error_));
    return false;
  }
}

fs::path tuning_directory() {
  if (!options::flag(options::Id::TuningStore)) return {};
  if (options::is_set(options::Id::TuningDir)) return options::value(options::Id::TuningDir);
  if (const auto xdg = options::environment("XDG_CACHE_HOME"); !xdg.empty())
    return fs::path(xdg) / "diffract" / "tuning";
  if (const auto home = options::environment("HOME"); !home.empty())
    return fs::path(home) / ".cache" / "diffract" / "tuning";
  return {};
}

fs::path tuning_file(const fs::path& dir, const TuningIdentity& identity) {
  std::string name;
  for (char c : identity.label) {
    const auto u = static_cast<unsigned char>(c);
    name += std::isalnum(u) ? static_cast<char>(std::tolower(u)) : '-';
  }
  if (name.size() > 48) name.resize(48);
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(fnv1a(identity.key())));
  return dir / ("tuning-" + (name.empty() ? std::string("gpu") : name) + "-" + hash + ".json");
}

namespace {
std::mutex g_stores_mutex;
std::map<std::string, std::unique_ptr<TuningStore>>& stores() {
  static std::map<std::string, std::unique_ptr<TuningStore>> s;
  return s;
}
}  // namespace

TuningStore& tuning_store(const TuningIdentity& identity) {
  std::lock_guard lock(g_stores_mutex);
  auto& s = stores()[identity.key()];
  if (!s) {
    const auto dir = tuning_directory();
    s = std::make_unique<TuningStore>(dir.empty() ? fs::path() : tuning_file(dir, identity), identity);
  }
  return *s;
}

void save_tuning_stores() {
  std::lock_guard lock(g_stores_mutex);
  for (auto& [key, s] : stores()) s->save();
}

}  // namespace diffract::io
