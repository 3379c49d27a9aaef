#include "core/util/torch_errors.h"

#include <algorithm>
#include <new>

#include <c10/util/Exception.h>

namespace diffract {

std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

std::optional<std::string> out_of_memory_reason(const std::exception& e) {
  const auto first_line = [](const std::string& s) { return s.substr(0, std::min(s.find('\n'), std::size_t{300})); };
  if (const auto* oom = dynamic_cast<const c10::OutOfMemoryError*>(&e)) return first_line(oom->what_without_backtrace());
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) {
    // alloc_cpu.cpp: "[enforce fail at alloc_cpu.cpp:N] err == 0. DefaultCPUAllocator: can't
    // allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)"
    const std::string m = c->what_without_backtrace();
    if (const auto at = m.find("DefaultCPUAllocator: can't allocate memory"); at != std::string::npos)
      return first_line(m.substr(at));
    return std::nullopt;
  }
  if (dynamic_cast<const std::bad_alloc*>(&e)) return "the host's memory allocator failed (std::bad_alloc)";
  return std::nullopt;
}

}  // namespace diffract
