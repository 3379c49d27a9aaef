// A PNG's text chunks from another app: A1111's "parameters", ComfyUI's "prompt" graph and our
// "diffract" JSON. The input is split at the first two NUL bytes into the three texts.
#include "core/engine/png_parameters.h"
#include "core/util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string all(reinterpret_cast<const char*>(data), size);
  std::string parts[3];
  std::size_t from = 0;
  for (int i = 0; i < 3; ++i) {
    const auto at = i < 2 ? all.find('\0', from) : std::string::npos;
    parts[i] = all.substr(from, at == std::string::npos ? std::string::npos : at - from);
    if (at == std::string::npos) break;
    from = at + 1;
  }
  const char* keys[3] = {"parameters", "prompt", "diffract"};
  for (int i = 0; i < 3; ++i) {
    try {
      diffract::engine::parse_png_parameters({{keys[i], parts[i]}}, "fuzz.png");
    } catch (const diffract::Error&) {
    }
  }
  try {
    diffract::engine::parse_png_parameters({{"parameters", parts[0]}, {"prompt", parts[1]}, {"diffract", parts[2]}},
                                           "fuzz.png");
  } catch (const diffract::Error&) {
  }
  return 0;
}
