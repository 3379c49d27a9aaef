#pragma once
// The image sizes Diffract offers (the GUI's size list) and the ones worth tuning a GPU for ahead
// of the first job: a model's native size and the offered sizes near its pixel count.
#include <vector>

namespace diffract::job {

struct SizePreset {
  const char* label;
  int width;
  int height;  // 0 x 0: the model's native size
};

// In the order the GUI lists them; the first is the model's native size. The SDXL entries are its
// training buckets (about 1 megapixel).
const std::vector<SizePreset>& size_presets();

struct Size {
  int width, height;
  bool operator==(const Size& o) const { return width == o.width && height == o.height; }
};

// The offered sizes other than the native one whose pixel count is within 0.4 to 1.6 times the
// native size's: what a designer switching aspect ratios on this model reaches for. Largest first.
std::vector<Size> sizes_to_tune(int native_size);

}  // namespace diffract::job
