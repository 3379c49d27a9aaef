#pragma once
// Where LoRA files are found by name: A1111's <lora:NAME:WEIGHT> tags and restored PNGs name a
// LoRA by its file's stem, looked up in the LoRA folders, then in the Hugging Face cache.
#include <filesystem>
#include <string>
#include <vector>

#include "core/job/request.h"

namespace diffract::engine {

// The .safetensors files under `dirs` (recursively, in the order given), then at the top of the
// Hugging Face cache's snapshots (`hub`; empty: none), by path.
std::vector<std::filesystem::path> find_lora_files(const std::vector<std::string>& dirs, const std::filesystem::path& hub);

// The file named `name` (its stem, case-insensitively; a path is taken as it is) among `files`;
// an error naming the nearest names when there is none.
std::filesystem::path find_lora(const std::string& name, const std::vector<std::filesystem::path>& files,
                                const std::vector<std::string>& dirs);

// What a LoRA file says of itself (its safetensors header; no tensor is read).
struct LoraFileInfo {
  std::filesystem::path path;
  std::string name;                        // the file's stem, as <lora:NAME> names it
  std::vector<std::string> trigger_words;  // kohya's ss_tag_frequency, most frequent first (at most 8)
  std::string base_model;                  // ss_base_model_version when written ("sdxl_base_v1-0", ...)
  std::string error;                       // why the header could not be read; empty when it could
};
LoraFileInfo read_lora_info(const std::filesystem::path& file);

// A1111's short hash of a LoRA file (12 hex digits of its "addnet" SHA-256, Civitai's AutoV3
// prefix), as its parameters text's "Lora hashes" carries it; "" without OpenSSL in this build.
std::string lora_short_hash(const std::filesystem::path& file);

// The file of every LoraRef given by name only (an empty path: a preset's LoRAs), and a LoraRef
// (named as the tag) for every <lora:NAME:WEIGHT> tag of the prompt that no LoraRef names yet,
// found in request.lora_dirs and the Hugging Face cache. Plain-syntax prompts have no tags.
void resolve_lora_tags(job::GenerationRequest& request);

}  // namespace diffract::engine
