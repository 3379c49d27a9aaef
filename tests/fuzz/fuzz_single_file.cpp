// A single-file checkpoint's family detection (SD 1.x / 2.x / XL, SD3, FLUX.1) from tensor names and
// shapes alone, as detection reads them. The input is text, a tensor per line: its name, then
// its dimensions ("model.diffusion_model.input_blocks.0.0.weight 320 4 3 3"), so shapes of any
// size cost nothing; make_seeds.py writes the fixtures' checkpoints this way. The lines are split
// by hand (no stream per line): the harness's own work stays small beside detection's.
#include <algorithm>
#include <charconv>
#include <string>
#include <string_view>
#include <vector>

#include "core/io/single_file.h"
#include "core/util/error.h"

namespace {

// The next field of `line` (fields are separated by spaces), removed from it; empty at the end.
std::string_view next_field(std::string_view& line) {
  while (!line.empty() && line.front() == ' ') line.remove_prefix(1);
  const auto end = std::min(line.find(' '), line.size());
  const auto field = line.substr(0, end);
  line.remove_prefix(end);
  return field;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<diffract::io::TensorShape> shapes;
  while (!text.empty() && shapes.size() < 100000) {
    const auto eol = std::min(text.find('\n'), text.size());
    std::string_view line = text.substr(0, eol);
    text.remove_prefix(std::min(eol + 1, text.size()));
    const auto name = next_field(line);
    if (name.empty()) continue;
    diffract::io::TensorShape t;
    t.name = std::string(name);
    t.shape.reserve(8);
    // The dimensions: the fields up to the first that is not a 64-bit integer.
    for (auto field = next_field(line); !field.empty() && t.shape.size() < 8; field = next_field(line)) {
      long long d = 0;
      const auto [end, error] = std::from_chars(field.data(), field.data() + field.size(), d);
      if (error != std::errc() || end != field.data() + field.size()) break;
      t.shape.push_back(d);
    }
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
