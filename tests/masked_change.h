#pragma once
// The inpainting tests' check: an inpainted image against the image it started from.
#include <algorithm>
#include <cstdint>
#include <vector>

namespace diffract::test {

// Pixel by pixel (RGB8), by a grey mask of the same size: `changed_outside` pixels that differ
// where the mask is 0, `kept` that do not, `repainted` that differ where it is 255.
struct MaskedChange {
  int kept = 0, changed_outside = 0, repainted = 0;
};

inline MaskedChange masked_change(const std::vector<std::uint8_t>& out, const std::vector<std::uint8_t>& original,
                                  const std::vector<std::uint8_t>& mask) {
  MaskedChange c;
  for (std::size_t i = 0; i < mask.size(); ++i) {
    const bool same = std::equal(&out[i * 3], &out[i * 3 + 3], &original[i * 3]);
    if (mask[i] == 0)
      ++(same ? c.kept : c.changed_outside);
    else if (mask[i] == 255 && !same)
      ++c.repainted;
  }
  return c;
}

}  // namespace diffract::test
