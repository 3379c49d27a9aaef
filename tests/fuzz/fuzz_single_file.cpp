// A single-file checkpoint's family detection (SD 1.x / 2.x / XL, SD3, FLUX.1) from tensor names and
// shapes alone, as detection reads them. The input is text, a tensor per line: its name, then
// its dimensions ("model.diffusion_model.input_blocks.0.0.weight 320 4 3 3"), so shapes of any
// size cost nothing; make_seeds.py writes the fixtures' checkpoints this way.
#include <sstream>

#include "core/io/single_file.h"
#include "core/util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  std::vector<diffract::io::TensorShape> shapes;
  for (std::string line; std::getline(in, line) && shapes.size() < 100000;) {
    std::istringstream fields(line);
    diffract::io::TensorShape t;
    if (!(fields >> t.name)) continue;
    for (long long d; t.shape.size() < 8 && fields >> d;) t.shape.push_back(d);
    shapes.push_back(std::move(t));
  }
  try {
    diffract::io::detect_single_file(shapes, "fuzz.safetensors");
  } catch (const diffract::Error&) {
  }
  try {
    if (diffract::io::is_sd3_single_file(shapes)) diffract::io::detect_sd3_single_file(shapes, "fuzz.safetensors");
  } catch (const diffract::Error&) {
  }
  try {
    if (diffract::io::is_flux_single_file(shapes)) diffract::io::detect_flux_single_file(shapes, "fuzz.safetensors");
  } catch (const diffract::Error&) {
  }
  return 0;
}
