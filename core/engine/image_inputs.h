#pragma once
// Init images and masks from files, for the CLI and the bench (the GUI reads through Qt).
#include <filesystem>
#include <string>
#include <vector>

#include "core/io/image.h"
#include "core/job/request.h"

namespace diffract::engine {

// The mask an image's alpha channel gives: transparent = repaint (255 - alpha as grey).
io::Image mask_from_alpha(const std::vector<std::uint8_t>& alpha, int width, int height);

// Reads `image` (and `mask` unless empty) into `in`. An image with transparency and no mask file
// is inpainted where it is transparent; a mask with an alpha channel counts only its opaque
// strokes. Returns what was converted (each a line for the user); errors name the file.
std::vector<std::string> load_image_inputs(job::ImageInputs& in, const std::filesystem::path& image,
                                           const std::filesystem::path& mask = {});

}  // namespace diffract::engine
