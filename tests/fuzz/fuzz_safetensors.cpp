// A safetensors file: header length, JSON header, dtypes, shapes, offsets against the data area.
#include "core/io/safetensors.h"
#include "core/util/error.h"
#include "fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  diffract::fuzz::MemoryFile file(data, size);
  if (!file.ok()) return 0;
  try {
    const auto archive = diffract::io::SafetensorsArchive::open(file.path());
    std::size_t sum = 0;
    for (const auto& t : archive->tensors())  // every byte a tensor claims is readable
      for (std::size_t i = 0; i < t.nbytes; i += 4096) sum += static_cast<std::size_t>(t.data[i]);
    for (const auto& [k, v] : archive->metadata()) sum += k.size() + v.size();
    if (sum == 1) return 0;
  } catch (const diffract::Error&) {
  }
  return 0;
}
