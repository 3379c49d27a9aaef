// A torch.save archive: the zip reader, the record sizes, the unpickler and tensor rebuilds.
#include "core/io/pth.h"
#include "core/util/error.h"
#include "fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  diffract::fuzz::MemoryFile file(data, size);
  if (!file.ok()) return 0;
  try {
    const auto weights = diffract::io::load_pth(file.path());
    double sum = 0;
    for (const auto& [name, t] : weights) sum += static_cast<double>(t.numel()) + static_cast<double>(name.size());
    if (sum < 0) return 0;
  } catch (const diffract::Error&) {
  }
  return 0;
}
