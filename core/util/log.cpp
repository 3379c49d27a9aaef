#include "core/util/log.h"

#include <mutex>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

namespace diffract::log {
namespace {
std::mutex g_mutex;
spdlog::level::level_enum g_level = spdlog::level::info;
}  // namespace

void Logger::debug(const std::string& m) const { impl_->debug(m); }
void Logger::info(const std::string& m) const { impl_->info(m); }
void Logger::warn(const std::string& m) const { impl_->warn(m); }
void Logger::error(const std::string& m) const { impl_->error(m); }

Logger get(const std::string& component) {
  std::lock_guard lock(g_mutex);
  const std::string name = "diffract." + component;
  if (auto existing = spdlog::get(name)) return Logger(existing);
  auto logger = spdlog::stderr_color_mt(name);
  logger->set_pattern("[%H:%M:%S.%e] [%n] [%^%l%$] %v");
  logger->set_level(g_level);
  return Logger(logger);
}

void set_verbose(bool verbose) {
  std::lock_guard lock(g_mutex);
  g_level = verbose ? spdlog::level::debug : spdlog::level::info;
  spdlog::apply_all([](const std::shared_ptr<spdlog::logger>& l) {
    if (l->name().rfind("diffract.", 0) == 0) l->set_level(g_level);
  });
}

}  // namespace diffract::log
