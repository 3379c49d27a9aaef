#include "core/io/key_maps.h"

#include <algorithm>

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

}  // namespace diffract::io
