#include "core/io/weights.h"

#include <torch/nn/module.h>

#include "core/io/pth.h"
#include "core/io/safetensors.h"
#include "core/io/upload.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace diffract::io {

namespace fs = std::filesystem;

namespace {

c10::ScalarType scalar_type(DType d) {
  switch (d) {
    case DType::F64: return c10::kDouble;
    case DType::F32: return c10::kFloat;
    case DType::F16: return c10::kHalf;
    case DType::BF16: return c10::kBFloat16;
    case DType::F8_E4M3: return c10::kFloat8_e4m3fn;
    case DType::F8_E5M2: return c10::kFloat8_e5m2;
    case DType::I64: return c10::kLong;
    case DType::I32: return c10::kInt;
    case DType::I16: return c10::kShort;
    case DType::I8: return c10::kChar;
    case DType::U8: return c10::kByte;
    case DType::BOOL: return c10::kBool;
  }
  throw Error("unreachable dtype");
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string shape_str(at::IntArrayRef shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

at::Tensor to_tensor(const std::shared_ptr<const SafetensorsArchive>& archive, const TensorInfo& info) {
  auto keep = archive;
  void* data = const_cast<std::byte*>(info.data);
  return at::from_blob(data, info.shape, [keep](void*) {}, at::TensorOptions().dtype(scalar_type(info.dtype)));
}

StateDict load_state_dict(const fs::path& path) {
  const std::string name = path.filename().string();
  if (ends_with(name, ".safetensors") || ends_with(name, ".safetensors.index.json")) {
    std::shared_ptr<const SafetensorsArchive> archive = SafetensorsArchive::open(path);
    StateDict out;
    for (const auto& t : archive->tensors()) out.emplace(t.name, to_tensor(archive, t));
    return out;
  }
  if (ends_with(name, ".pth") || ends_with(name, ".pt") || ends_with(name, ".bin") || ends_with(name, ".ckpt")) {
    return load_pth(path);
  }
  throw Error(path.string() + ": unknown checkpoint format (expected .safetensors, .safetensors.index.json, "
              ".pth, .pt, .bin or .ckpt)");
}

BindReport bind(torch::nn::Module& module, const StateDict& weights, const std::string& what,
                const BindOptions& options) {
  BindReport report;
  std::map<std::string, at::Tensor> targets;
  for (const auto& p : module.named_parameters(true)) targets.emplace(p.key(), p.value());
  for (const auto& b : module.named_buffers(true)) targets.emplace(b.key(), b.value());

  for (const auto& [key, tensor] : weights) {
    if (targets.count(key)) continue;
    if (std::find(options.ignore_unexpected.begin(), options.ignore_unexpected.end(), key) !=
        options.ignore_unexpected.end())
      continue;
    report.unexpected.push_back(key);
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  for (const auto& [key, target] : targets) {
    auto it = weights.find(key);
    if (it == weights.end()) {
      report.missing.push_back(key);
    } else if (it->second.sizes() != target.sizes()) {
      report.mismatched.push_back(key + ": checkpoint " + shape_str(it->second.sizes()) + " vs model " +
                                  shape_str(target.sizes()));
    } else {
      copies.emplace_back(target, it->second);
    }
  }

  const bool bad = !report.missing.empty() || !report.unexpected.empty() || !report.mismatched.empty();
  if (bad && options.strict) {
    std::string msg = what + ": weights do not match the model";
    auto list = [&msg](const char* title, const std::vector<std::string>& keys) {
      if (keys.empty()) return;
      msg += "\n" + std::string(title) + " (" + std::to_string(keys.size()) + "):";
      for (const auto& k : keys) msg += "\n  " + k;
    };
    list("missing keys", report.missing);
    list("unexpected keys", report.unexpected);
    list("shape mismatches", report.mismatched);
    throw Error(msg);
  }
  {
    at::NoGradGuard no_grad;
    const auto faults = mapping_faults();
    if (auto* upload = ScopedPlacement::current()) {
      for (auto& [target, source] : copies) target.set_data(upload->upload(source));
      upload->finish();
    } else {
      for (auto& [target, source] : copies) target.copy_(source);
    }
    if (mapping_faults() != faults)
      throw Error(what + ": the file changed on disk while it was being read (truncated or rewritten by another "
                         "program?): the load was abandoned; load it again");
  }
  report.bound = copies.size();
  if (bad)
    log::get("io").warn(log::str(what, ": ", report.missing.size(), " missing, ", report.unexpected.size(),
                                 " unexpected, ", report.mismatched.size(), " mismatched keys (non-strict load)"));
  return report;
}

}  // namespace diffract::io
