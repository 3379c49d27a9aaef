#pragma once
// LoRA files as found in the wild, read into one form: per layer its kind and tensors, named by
// the component and module they patch in our models (diffusers' / transformers' module names).
//   kohya / A1111     lora_unet_<module with _>, lora_te_ / lora_te1_ / lora_te2_<module with _>;
//                     .lora_down / .lora_up (.lora_mid: LoCon's Tucker core), .alpha. The UNet's
//                     modules in diffusers' names (SD 1.x) or the original ones (input_blocks_4_1_...:
//                     SDXL); text encoders in transformers' names (text_model_encoder_layers_0_...)
//   LyCORIS           LoCon (conv layers, as above), LoHa (.hada_w1_a, .hada_w1_b, .hada_w2_a,
//                     .hada_w2_b, .hada_t1 / .hada_t2), LoKr (.lokr_w1 or .lokr_w1_a / _b, .lokr_w2
//                     or .lokr_w2_a / _b, .lokr_t2)
//   diffusers / PEFT  unet. / text_encoder. / text_encoder_2. / transformer.<module>.lora_A / .lora_B
//                     (.default optional), alphas from .alpha keys or the file's lora_adapter_metadata
//                     (lora_alpha, alpha_pattern); no alpha: alpha = rank
// Underscored names are matched against the model's own module names (an underscore is
// ambiguous), so the file is resolved for a model: resolve_lora().
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/io/weights.h"

namespace diffract::io {

enum class LoraKind { LoRA, LoHa, LoKr };

// One layer's update, before scaling.
struct LoraLayer {
  std::string source;     // the file's name for the layer ("lora_unet_..._to_q", "unet.down_blocks...")
  std::string component;  // "unet", "text_encoder", "text_encoder_2", "transformer"
  std::string module;     // our module name in that component ("down_blocks.1.attentions.0...to_q")
  LoraKind kind = LoraKind::LoRA;
  // "down", "up", "mid"; "w1_a", "w1_b", "w2_a", "w2_b", "t1", "t2"; "w1", "w2": as stored (views of
  // the file's mapping, which they keep alive).
  std::map<std::string, at::Tensor> tensors;
  std::optional<double> alpha;                // absent: alpha = rank (scale 1)
  int64_t rank() const;                       // the update's inner dimension (0 when it has none: a full LoKr)
  // weight x alpha / rank (A1111's scale), 1 x weight without alpha or rank.
  double scale(double weight) const;
};

// The model a file is resolved for: per component, its weight-bearing modules (the names of the
// 2-D and 4-D ".weight" tensors, without ".weight") with their weights' shapes.
struct LoraModelModules {
  std::map<std::string, std::map<std::string, std::vector<int64_t>>> components;
};

struct ResolvedLora {
  std::filesystem::path path;
  std::string hash;                  // A1111's short hash (lora_file_hash's first 12); empty without OpenSSL
  std::string format;                // "kohya", "diffusers", "lycoris"
  std::vector<LoraLayer> layers;     // every one checked against its module's shape
  std::vector<std::string> unmatched;  // the file's layers no module of the model matches (by the file's names)
  std::map<std::string, int> per_component;  // layers matched per component
};

// Reads `path` (a .safetensors LoRA) and resolves it for `model`. A file that is not a LoRA
// (no LoRA keys at all, or a whole checkpoint), tensors of the wrong rank, a layer whose update
// does not fit its module's weight (a LoRA for another model family: the first such layer is
// named) and unknown key kinds are diffract::Error naming the file. Layers naming modules the
// model lacks are listed in `unmatched` (the caller decides: strict or lenient).
ResolvedLora resolve_lora(const std::filesystem::path& path, const LoraModelModules& model);

// A1111's hash of a .safetensors file (its "addnet" hash, Civitai's AutoV3): SHA-256 of the bytes
// after the header, in hex; "" when this build has no OpenSSL. A1111's parameters text shows the
// first 12 digits.
std::string lora_file_hash(const std::filesystem::path& file);

// The original (LDM / SGM) UNet module name of a diffusers UNet module ("down_blocks.1.attentions.0.proj_in"
// -> "input_blocks.4.1.proj_in"), given all of the UNet's module names (the block structure comes
// from them); empty for a module without one.
std::map<std::string, std::string> ldm_unet_module_names(const std::vector<std::string>& diffusers_modules);

}  // namespace diffract::io
