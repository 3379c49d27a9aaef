#pragma once
#include <memory>
#include <sstream>
#include <string>

namespace spdlog { class logger; }

namespace diffract::log {

// A named component logger ("io", "text", "models", "engine", ...) over spdlog, writing to
// stderr. Messages are plain strings: LibTorch bundles its own fmt, which clashes with the
// one spdlog is built against, so no fmt header is exposed here.
class Logger {
 public:
  explicit Logger(std::shared_ptr<spdlog::logger> impl) : impl_(std::move(impl)) {}
  void debug(const std::string& message) const;
  void info(const std::string& message) const;
  void warn(const std::string& message) const;
  void error(const std::string& message) const;

 private:
  std::shared_ptr<spdlog::logger> impl_;
};

Logger get(const std::string& component);

// Debug output from every component when true; info and above otherwise.
void set_verbose(bool verbose);

// Streams its arguments into one message: log::get("io").info(log::str(path, ": ", n, " tensors")).
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

}  // namespace diffract::log
