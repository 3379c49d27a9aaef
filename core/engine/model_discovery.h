#pragma once
// Models on this machine: diffusers pipelines in the Hugging Face cache, and the TAESD that
// previews a model's latent space. No torch headers: the GUI and the CLI include this.
#include <filesystem>
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

// The newest madebyollin TAESD snapshot in `hub` for a diffusers model folder's pipeline
// (taesd, taesdxl, taesd3, taef1); empty when there is none or the folder is not diffusers'.
std::filesystem::path matching_taesd(const std::filesystem::path& model_dir, const std::filesystem::path& hub);
inline std::filesystem::path matching_taesd(const std::filesystem::path& model_dir) {
  return matching_taesd(model_dir, hugging_face_hub());
}

}  // namespace diffract::engine
