#pragma once
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::nn { class Module; }

namespace diffract::io {

class SafetensorsArchive;
struct TensorInfo;

using StateDict = std::map<std::string, at::Tensor>;

// A CPU tensor viewing the archive's mapping without copying; it keeps the archive alive.
at::Tensor to_tensor(const std::shared_ptr<const SafetensorsArchive>& archive, const TensorInfo& info);

// Loads a checkpoint by its extension: `.safetensors`, `.safetensors.index.json` (shards),
// or a `torch.save` zip (`.pth`, `.pt`, `.bin`, `.ckpt`) holding a state dict (directly or
// under "state_dict"). Safetensors tensors are zero-copy views; pickled ones are read.
StateDict load_state_dict(const std::filesystem::path& path);

struct BindOptions {
  bool strict = true;
  // Checkpoint keys that are known and deliberately unused (e.g. non-persistent buffers
  // that older exports still carry); never reported as unexpected.
  std::vector<std::string> ignore_unexpected;
};

struct BindReport {
  std::vector<std::string> missing;     // module parameters/buffers with no checkpoint key
  std::vector<std::string> unexpected;  // checkpoint keys the module does not have
  std::vector<std::string> mismatched;  // "key: checkpoint [..] vs module [..]"
  std::size_t bound = 0;
};

// Copies checkpoint tensors into the module's parameters and buffers, whose names must
// equal the keys (converting dtype and device); under an io::ScopedPlacement (upload.h) the
// bound tensors are replaced by new ones on the placement's device and dtype instead. Strict mode throws one error listing every
// missing, unexpected and mismatched key, naming `what` (usually the weight file).
BindReport bind(torch::nn::Module& module, const StateDict& weights, const std::string& what,
                const BindOptions& options = {});

}  // namespace diffract::io
