#pragma once
// LoRAs patched into a loaded model's weights in place: W += scale x update for every layer a
// file names (core/io/lora_file.h reads them), in fp32 and rounded once to the weight's dtype.
// The tensors stay where they are (views into fused projections included), so CUDA graphs
// captured before stay valid. The originals of the weights touched are kept, on their own device
// (on the CPU when the device has no room), so that the next job's set starts from the model as
// loaded, without reloading it; the files of the set applied stay read, so that a change of
// weight reads nothing.
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "core/io/lora_file.h"
#include "core/job/request.h"

namespace torch::nn {
class Module;
}

namespace diffract::adapters {

// A component a LoRA may patch: "unet", "text_encoder", "text_encoder_2", "transformer".
struct LoraComponent {
  std::string name;
  torch::nn::Module* module = nullptr;
  bool text_encoder = false;  // scaled by the text-encoder weight
};

// The components' weight-bearing modules, as io::resolve_lora() matches against.
io::LoraModelModules lora_modules(const std::vector<LoraComponent>& components);

// One layer's update [rows, ...] as the weight's shape `shape`, on `device` in fp32, unscaled.
at::Tensor lora_update(const io::LoraLayer& layer, at::IntArrayRef shape, const c10::Device& device);

struct AppliedLora {
  job::LoraRef ref;
  std::string format;
  std::string hash;                    // A1111's short hash; empty without OpenSSL
  std::map<std::string, int> layers;   // per component
  std::vector<std::string> unmatched;  // ignored (lenient)
  nlohmann::json json() const;
};

class LoraPatcher {
 public:
  // Makes `loras` the applied set: nothing when it is the set applied now (same files, sizes,
  // times and weights), else the originals back and the new set patched. Every file is read and
  // checked before any weight changes, so an error leaves the model as it was. Returns whether
  // weights changed (replicas of the model made before are stale then).
  bool apply(const std::vector<job::LoraRef>& loras, const std::vector<LoraComponent>& components, bool lenient);
  // The model as loaded.
  void restore();
  const std::vector<AppliedLora>& applied() const { return applied_; }
  double last_apply_ms() const { return last_apply_ms_; }

 private:
  std::string key_;
  std::vector<std::pair<at::Tensor, at::Tensor>> originals_;  // weight, its original
  std::map<std::string, io::ResolvedLora> files_;               // by path|size|time: the set applied
  std::vector<AppliedLora> applied_;
  double last_apply_ms_ = 0;
};

}  // namespace diffract::adapters
