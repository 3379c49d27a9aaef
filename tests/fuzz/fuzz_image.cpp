// An input image as a user drops it: PNG (any depth, palette, alpha, text chunks) or JPEG.
#include "core/io/image.h"
#include "core/util/error.h"
#include "fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  diffract::fuzz::MemoryFile file(data, size);
  if (!file.ok()) return 0;
  try {
    const auto decoded = diffract::io::read_image(file.path());
    if (decoded.image.rgb.size() == 1) return 0;
  } catch (const diffract::Error&) {
  }
  try {
    diffract::io::PngText text;
    diffract::io::read_png(file.path(), &text);
  } catch (const diffract::Error&) {
  }
  return 0;
}
