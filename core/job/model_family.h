#pragma once
// The model families Diffract runs. No torch headers.
#include <string>
#include <string_view>

namespace diffract::job {

enum class ModelFamily { SD1, SD2, SDXL, SD3, Flux };

// "sd1", "sd2", "sdxl", "sd3", "flux": the names in job metadata and in the strategy registry.
std::string_view family_name(ModelFamily family);
// Whether the family's denoiser is a UNet (SD 1.x / 2.x / XL) rather than a transformer.
inline bool has_unet(ModelFamily family) { return family != ModelFamily::SD3 && family != ModelFamily::Flux; }

}  // namespace diffract::job
