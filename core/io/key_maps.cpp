#include "core/io/key_maps.h"

#include <algorithm>
#include <cctype>

#include "core/util/error.h"

namespace diffract::io {

namespace {
bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }
}  // namespace

StateDict map_clip_text_keys(StateDict weights) {
  const bool unprefixed = std::any_of(weights.begin(), weights.end(), [](const auto& kv) {
    return starts_with(kv.first, "embeddings.") || starts_with(kv.first, "encoder.layers.");
  });
  if (!unprefixed) return weights;
  StateDict out;
  for (auto& [key, tensor] : weights) {
    const bool inner = starts_with(key, "embeddings.") || starts_with(key, "encoder.") ||
                       starts_with(key, "final_layer_norm.");
    out.emplace(inner ? "text_model." + key : key, std::move(tensor));
  }
  return out;
}

StateDict map_t5_encoder_keys(StateDict weights) {
  const auto tied = weights.find("encoder.embed_tokens.weight");
  if (tied == weights.end()) return weights;
  if (!weights.count("shared.weight")) weights.emplace("shared.weight", tied->second);
  weights.erase("encoder.embed_tokens.weight");
  return weights;
}

StateDict map_taesd_keys(StateDict weights, const std::string& part) {
  if (part != "encoder" && part != "decoder")
    throw Error("map_taesd_keys: part must be \"encoder\" or \"decoder\", got \"" + part + "\"");
  const int shift = part == "decoder" ? 1 : 0;
  StateDict out;
  for (auto& [key, tensor] : weights) {
    std::size_t digits = 0;
    while (digits < key.size() && std::isdigit(static_cast<unsigned char>(key[digits]))) ++digits;
    if (digits == 0 || digits > 6 || digits >= key.size() || key[digits] != '.') {  // diffusers' layout, or unknown
      out.emplace(key, std::move(tensor));
      continue;
    }
    const int index = std::stoi(key.substr(0, digits)) - shift;
    if (index < 0) throw Error("TAESD decoder key '" + key + "': index 0 is the parameter-free clamp");
    out.emplace(part + ".layers." + std::to_string(index) + key.substr(digits), std::move(tensor));
  }
  return out;
}

}  // namespace diffract::io
