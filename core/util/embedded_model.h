#pragma once
#include <filesystem>

namespace diffract {

// The embedded emoji model's diffusers folder (resources/models/diffract-emoji): from
// $DIFFRACT_EMBEDDED_MODEL, else installed beside the program (<prefix>/share/diffract/models/),
// else in the source tree this build came from. Empty when none holds a model_index.json.
std::filesystem::path embedded_model_dir();

}  // namespace diffract
