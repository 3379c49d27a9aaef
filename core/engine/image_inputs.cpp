#include "core/engine/image_inputs.h"

#include "core/util/error.h"

namespace diffract::engine {

io::Image mask_from_alpha(const std::vector<std::uint8_t>& alpha, int width, int height) {
  if (alpha.size() != static_cast<std::size_t>(width) * height) throw Error("alpha channel of the wrong size");
  io::Image m{width, height, std::vector<std::uint8_t>(alpha.size() * 3)};
  for (std::size_t i = 0; i < alpha.size(); ++i) m.rgb[i * 3] = m.rgb[i * 3 + 1] = m.rgb[i * 3 + 2] = 255 - alpha[i];
  return m;
}

std::vector<std::string> load_image_inputs(job::ImageInputs& in, const std::filesystem::path& image,
                                           const std::filesystem::path& mask) {
  auto decoded = io::read_image(image);
  std::vector<std::string> notes = decoded.notes;
  in.image = std::move(decoded.image);
  if (!mask.empty()) {
    auto m = io::read_image(mask);
    notes.insert(notes.end(), m.notes.begin(), m.notes.end());
    if (!m.alpha.empty()) {
      // Strokes on a transparent layer: only what is opaque counts.
      for (std::size_t i = 0; i < m.alpha.size(); ++i)
        for (int c = 0; c < 3; ++c) {
          auto& v = m.image.rgb[i * 3 + c];
          v = static_cast<std::uint8_t>((v * m.alpha[i] + 127) / 255);
        }
      notes.push_back(mask.filename().string() + ": its transparent pixels count as black (keep)");
    }
    in.mask = std::move(m.image);
  } else if (!decoded.alpha.empty()) {
    in.mask = mask_from_alpha(decoded.alpha, in.image.width, in.image.height);
    notes.push_back(image.filename().string() +
                    ": its alpha channel is the mask (transparent pixels are repainted); give --mask to choose another");
  }
  return notes;
}

}  // namespace diffract::engine
