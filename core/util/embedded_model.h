#pragma once
#include <filesystem>

namespace diffract {

// The embedded emoji model's diffusers folder (resources/models/diffract-emoji): installed
// beside the program (<prefix>/share/diffract/models/), else in the source tree this build came
// from; $DIFFRACT_EMBEDDED_MODEL, when set, is the only place looked at. Empty when none holds
// a model_index.json.
std::filesystem::path embedded_model_dir();
// Beside it: the inpainting model fine-tuned from it (diffract-emoji-inpaint; empty when that
// folder holds no model_index.json) and the folder of LoRAs trained on it (loras; empty when absent).
std::filesystem::path embedded_inpainting_model_dir();
std::filesystem::path embedded_lora_dir();

}  // namespace diffract
