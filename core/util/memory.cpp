#include "core/util/memory.h"

#include <unistd.h>

#include <cstdio>

#include "core/util/error.h"

namespace diffract {

std::uint64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

void check_fits_in_memory(std::int64_t parameters, const std::string& what) {
  const std::uint64_t have = physical_memory_bytes();
  const double need = 4.0 * static_cast<double>(parameters);
  if (have == 0 || need <= static_cast<double>(have)) return;
  char text[160];
  std::snprintf(text, sizeof text, " has about %.3g billion parameters: building it needs %.1f GB, more than this "
                "machine's %.1f GB", static_cast<double>(parameters) / 1e9, need / 1e9, static_cast<double>(have) / 1e9);
  throw Error(what + text);
}

double decode_peak_bytes(int width, int height, int batch, int value_bytes) {
  return 5.0 * 128.0 * static_cast<double>(width) * static_cast<double>(height) * static_cast<double>(batch) *
         static_cast<double>(value_bytes);
}

}  // namespace diffract
