#include "core/job/sizes.h"

#include <algorithm>

namespace diffract::job {

const std::vector<SizePreset>& size_presets() {
  static const std::vector<SizePreset> all = {
      {"Model default", 0, 0},
      {"512 × 512 (1:1)", 512, 512},
      {"768 × 768 (1:1)", 768, 768},
      {"1024 × 1024 (1:1, SDXL)", 1024, 1024},
      {"640 × 480 (4:3)", 640, 480},
      {"768 × 576 (4:3)", 768, 576},
      {"1152 × 864 (4:3)", 1152, 864},
      {"768 × 432 (16:9)", 768, 432},
      {"1024 × 576 (16:9)", 1024, 576},
      {"1344 × 768 (SDXL 16:9)", 1344, 768},
      {"768 × 1344 (SDXL 9:16)", 768, 1344},
      {"1152 × 896 (SDXL)", 1152, 896},
      {"896 × 1152 (SDXL)", 896, 1152},
      {"1216 × 832 (SDXL)", 1216, 832},
      {"832 × 1216 (SDXL)", 832, 1216},
      {"1536 × 640 (SDXL)", 1536, 640},
      {"640 × 1536 (SDXL)", 640, 1536},
  };
  return all;
}

std::vector<Size> sizes_to_tune(int native_size) {
  std::vector<Size> out;
  if (native_size <= 0) return out;
  const double native = static_cast<double>(native_size) * native_size;
  for (const auto& p : size_presets()) {
    if (p.width <= 0 || p.height <= 0 || (p.width == native_size && p.height == native_size)) continue;
    const double share = static_cast<double>(p.width) * p.height / native;
    if (share >= 0.4 && share <= 1.6) out.push_back({p.width, p.height});
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const Size& a, const Size& b) { return a.width * a.height > b.width * b.height; });
  return out;
}

}  // namespace diffract::job
