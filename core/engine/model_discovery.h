#pragma once
// Models on this machine: diffusers pipelines in the Hugging Face cache, and the TAESD that
// previews a model's latent space. No torch headers: the GUI and the CLI include this.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace diffract::engine {

// The Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub.
std::filesystem::path hugging_face_hub();

// The newest snapshot (by modification time) of each models--org--name repository in `hub` that
// is a diffusers pipeline (holds model_index.json), repositories in name order.
std::vector<std::filesystem::path> discover_hugging_face_models(const std::filesystem::path& hub);
inline std::vector<std::filesystem::path> discover_hugging_face_models() {
  return discover_hugging_face_models(hugging_face_hub());
}

// "org/name" for a snapshot folder models--org--name/snapshots/<hash>; "" for any other path.
std::string hugging_face_repo_name(const std::filesystem::path& snapshot);

// A model's family from its files alone, without loading it: "SD" (1.x / 2.x), "SDXL", "SD3" or
// "Flux", from a diffusers folder's pipeline class or a .safetensors single file's tensor names.
// Empty when unknown or unreadable.
std::string guess_model_family(const std::filesystem::path& model);

// The side in pixels a model was trained at, from its files alone: a diffusers folder's UNet or
// transformer sample_size times its VAE's downscale (Flux: 1024); a single file's family's
// (SD 512, SDXL / SD3 / Flux 1024). Nothing when unknown or unreadable.
std::optional<int> guess_native_size(const std::filesystem::path& model);
// The same for a model whose family guess_model_family() gave already.
std::optional<int> guess_native_size(const std::filesystem::path& model, const std::string& family);

// About what loading a model puts in memory at its stored precision: a single file's size, or a
// diffusers folder's weight files (.safetensors, .bin, .pth, .ckpt; linked folders followed), each
// component's variant files (".fp16.") left out where plain ones exist. 0 when unreadable.
std::uint64_t model_weight_bytes(const std::filesystem::path& model);

// The newest madebyollin TAESD snapshot in `hub` (taesd, taesdxl, taesd3, taef1: a diffusers
// AutoencoderTiny folder or the original <name>_decoder.pth) for a model's latent space: a diffusers
// folder's pipeline class, or a .safetensors single file's family from its tensor names. Empty when
// there is none or the model cannot be read.
std::filesystem::path matching_taesd(const std::filesystem::path& model, const std::filesystem::path& hub);
inline std::filesystem::path matching_taesd(const std::filesystem::path& model) {
  return matching_taesd(model, hugging_face_hub());
}

}  // namespace diffract::engine
