#pragma once
// Choices made by timing on a GPU (a GEMM's cuBLASLt algorithm, a convolution's cuDNN plan, a
// layer's fp8 or bf16), kept on disk so that a size tuned once is not tuned again: one JSON file
// per GPU model and software stack (the identity), in tuning_directory(). Each choice is a record
// in a named table ("gemm", "conv", "fp8") under a key its owner makes from the shape; the
// owner validates a record when it reads it and tunes again where it cannot use it.
//
// The file is a cache: a missing, unreadable or damaged one, or one written for another identity,
// is logged (naming the file and what is wrong) and its records are not used; nothing throws into
// a job. save() merges with what another process may have written since and replaces the file
// atomically.
#include <cstddef>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace diffract::io {

// What tuned choices are valid for: the GPU, its driver and the libraries that ran the timings.
struct TuningIdentity {
  std::string label;                          // readable, for the file name ("NVIDIA H200")
  std::map<std::string, std::string> fields;  // "gpu", "capability", "driver", "cuda", "cublaslt", ...
  std::string key() const;                    // every field, in order
};

class TuningStore {
 public:
  static constexpr int kFormatVersion = 1;
  static constexpr std::size_t kMaxFileBytes = std::size_t(32) << 20;
  static constexpr std::size_t kMaxRecordsPerTable = 100000;

  // Reads `file` when it exists (problems: load_problem()). An empty path keeps the records in
  // memory only.
  TuningStore(std::filesystem::path file, TuningIdentity identity);

  std::optional<nlohmann::json> find(const std::string& table, const std::string& key) const;
  void put(const std::string& table, const std::string& key, nlohmann::json record);
  std::size_t size(const std::string& table) const;
  bool dirty() const;

  // Writes the records to the file if any changed since the last save (merged over the file's
  // current records); false, with the reason logged and in last_error(), when it could not.
  bool save();

  const std::filesystem::path& file() const { return file_; }
  const TuningIdentity& identity() const { return identity_; }
  std::string load_problem() const;  // why the file's records were not used; "" when they were or there was no file
  std::string last_error() const;

  // The file's tables when its contents are a valid store of `identity`; otherwise nothing, with
  // the reason in `problem`. Never throws (the fuzz harness's entry point).
  static std::optional<nlohmann::json> parse(const std::string& text, const TuningIdentity& identity,
                                             std::string& problem);

 private:
  std::filesystem::path file_;
  TuningIdentity identity_;
  mutable std::mutex mutex_;
  nlohmann::json tables_ = nlohmann::json::object();
  bool dirty_ = false;
  std::string load_problem_, last_error_;
};

// Where the stores live: DIFFRACT_TUNING_DIR, else $XDG_CACHE_HOME/diffract/tuning, else
// ~/.cache/diffract/tuning; empty (memory only) when DIFFRACT_TUNING_STORE is 0 or no home is known.
std::filesystem::path tuning_directory();
// The file for `identity` in `dir`: its label made safe for a file name, and a hash of its key.
std::filesystem::path tuning_file(const std::filesystem::path& dir, const TuningIdentity& identity);

// The process's store for `identity` (made, and its file read, on first use).
TuningStore& tuning_store(const TuningIdentity& identity);
// Saves every store with unsaved records (after a job, a warm-up or a prepare).
void save_tuning_stores();

}  // namespace diffract::io
