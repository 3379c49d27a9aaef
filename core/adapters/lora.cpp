#include "core/adapters/lora.h"

#include <chrono>
#include <filesystem>
#include <set>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "core/util/error.h"
#include "core/util/log.h"

namespace diffract::adapters {

namespace fs = std::filesystem;

namespace {

std::map<std::string, at::Tensor> weights_of(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  const std::string suffix = ".weight";
  for (const auto& p : m.named_parameters(/*recurse=*/true)) {
    const auto& key = p.key();
    if (key.size() <= suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    if (p.value().dim() != 2 && p.value().dim() != 4) continue;
    out.emplace(key.substr(0, key.size() - suffix.size()), p.value());
  }
  return out;
}

// A file as it is on disk now: its path, size and modification time.
std::string file_key(const std::string& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  const auto time = fs::last_write_time(path, ec).time_since_epoch().count();
  return path + "|" + std::to_string(size) + "|" + std::to_string(time);
}

std::string set_key(const std::vector<job::LoraRef>& loras) {
  std::string key;
  for (const auto& l : loras)
    key += file_key(l.path) + "|" + std::to_string(l.weight) + "|" + std::to_string(l.text_encoder_weight) + "\n";
  return key;
}

// A copy of `w` on its device, or on the CPU when the device has no room for it.
at::Tensor backup(const at::Tensor& w) {
  if (w.is_cuda()) {
    try {
      return w.clone();
    } catch (const c10::OutOfMemoryError&) {
    }
  }
  return w.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
}

at::Tensor tucker(const at::Tensor& t, const at::Tensor& wa, const at::Tensor& wb) {
  // t [i, j, k, l], wa [i, p], wb [j, r] -> [p, r, k, l] (LyCORIS' rebuild_tucker)
  return at::einsum("ijkl,ip,jr->prkl", {t, wa, wb});
}

}  // namespace

io::LoraModelModules lora_modules(const std::vector<LoraComponent>& components) {
  io::LoraModelModules m;
  for (const auto& c : components) {
    if (!c.module) continue;
    auto& mods = m.components[c.name];
    for (const auto& [name, w] : weights_of(*c.module)) mods[name] = w.sizes().vec();
  }
  return m;
}

at::Tensor lora_update(const io::LoraLayer& l, at::IntArrayRef shape, const c10::Device& device) {
  const auto get = [&](const char* k) {
    const auto it = l.tensors.find(k);
    return it == l.tensors.end() ? at::Tensor() : it->second.to(device, at::kFloat);
  };
  at::Tensor u;
  switch (l.kind) {
    case io::LoraKind::LoRA: {
      const auto up = get("up"), down = get("down"), mid = get("mid");
      if (mid.defined())
        u = at::einsum("nmkl,in,mj->ijkl", {mid, up.reshape({up.size(0), -1}), down.reshape({down.size(0), -1})});
      else
        u = at::mm(up.reshape({up.size(0), -1}), down.reshape({down.size(0), -1}));
      break;
    }
    case io::LoraKind::LoHa: {
      const auto t1 = get("t1"), t2 = get("t2");
      const auto w1 = t1.defined() ? tucker(t1, get("w1_a"), get("w1_b")) : at::mm(get("w1_a"), get("w1_b").flatten(1));
      const auto w2 = t2.defined() ? tucker(t2, get("w2_a"), get("w2_b")) : at::mm(get("w2_a"), get("w2_b").flatten(1));
      u = w1 * w2;
      break;
    }
    case io::LoraKind::LoKr: {
      auto w1 = get("w1");
      if (!w1.defined()) w1 = at::mm(get("w1_a"), get("w1_b"));
      auto w2 = get("w2");
      if (!w2.defined()) {
        const auto t2 = get("t2");
        w2 = t2.defined() ? tucker(t2, get("w2_a"), get("w2_b")) : at::mm(get("w2_a"), get("w2_b").flatten(1));
      }
      if (w2.dim() == 4) w1 = w1.unsqueeze(2).unsqueeze(3);
      u = at::kron(w1, w2);
      break;
    }
  }
  return u.reshape(shape);
}

nlohmann::json AppliedLora::json() const {
  nlohmann::json j = {{"path", ref.path}, {"name", ref.name.empty() ? fs::path(ref.path).stem().string() : ref.name},
                      {"weight", ref.weight}, {"text_encoder_weight", ref.text_encoder_weight},
                      {"format", format}, {"layers", layers}};
  if (!unmatched.empty()) j["unmatched"] = unmatched.size();
  if (!hash.empty()) j["hash"] = hash;
  return j;
}

void LoraPatcher::restore() {
  at::NoGradGuard no_grad;
  for (auto& [w, original] : originals_) w.copy_(original, /*non_blocking=*/false);
  originals_.clear();
  applied_.clear();
  files_.clear();
  key_.clear();
}

bool LoraPatcher::apply(const std::vector<job::LoraRef>& loras, const std::vector<LoraComponent>& components, bool lenient) {
  const auto key = set_key(loras);
  if (key == key_) return false;
  const auto t0 = std::chrono::steady_clock::now();
  // Read and check everything first.
  io::LoraModelModules modules;
  std::map<std::string, io::ResolvedLora> files;  // the new set's, by file_key
  std::vector<const io::ResolvedLora*> order;
  for (const auto& ref : loras) {
    if (!(ref.weight == ref.weight) || !(ref.text_encoder_weight == ref.text_encoder_weight))
      throw Error("LoRA " + ref.path + ": its weight is not a number");
    const auto fk = file_key(ref.path);
    if (const auto it = files.find(fk); it != files.end()) {
      order.push_back(&it->second);
      continue;
    }
    if (const auto it = files_.find(fk); it != files_.end()) {  // read for the set applied now
      order.push_back(&files.emplace(fk, it->second).first->second);
      continue;
    }
    if (modules.components.empty()) modules = lora_modules(components);
    auto r = io::resolve_lora(ref.path, modules);
    if (r.layers.empty())
      throw Error("LoRA " + ref.path + " matches no layer of this model (its layers name " +
                  (r.unmatched.empty() ? std::string("nothing") : r.unmatched.front()) + ", ...): it is for another model family");
    if (!r.unmatched.empty()) {
      std::string list;
      for (std::size_t i = 0; i < r.unmatched.size() && i < 6; ++i) list += (i ? ", " : "") + r.unmatched[i];
      if (r.unmatched.size() > 6) list += " and " + std::to_string(r.unmatched.size() - 6) + " more";
      const auto what = "LoRA " + ref.path + ": " + std::to_string(r.unmatched.size()) + " of its " +
                        std::to_string(r.unmatched.size() + r.layers.size()) + " layers match no module of this model (" +
                        list + ")";
      if (!lenient) throw Error(what + "; --lora-lenient applies the rest");
      log::get("lora").warn(what + ": left out (lenient)");
    }
    order.push_back(&files.emplace(fk, std::move(r)).first->second);
  }
  restore();
  at::NoGradGuard no_grad;
  std::map<std::string, std::map<std::string, at::Tensor>> weights;
  std::map<std::string, bool> is_text;
  for (const auto& c : components)
    if (c.module) {
      weights[c.name] = weights_of(*c.module);
      is_text[c.name] = c.text_encoder;
    }
  std::set<const void*> saved;
  try {
  for (std::size_t i = 0; i < order.size(); ++i) {
    const auto& ref = loras[i];
    const auto& file = *order[i];
    AppliedLora a;
    a.ref = ref;
    a.format = file.format;
    a.hash = file.hash;
    a.layers = file.per_component;
    a.unmatched = file.unmatched;
    for (const auto& layer : file.layers) {
      auto& w = weights.at(layer.component).at(layer.module);
      const double scale = layer.scale(is_text[layer.component] ? ref.text_encoder_weight : ref.weight);
      if (scale == 0) continue;
      if (saved.insert(w.unsafeGetTensorImpl()).second) originals_.emplace_back(w, backup(w));
      const auto u = lora_update(layer, w.sizes(), w.device());
      w.copy_(w.to(at::kFloat).add_(u, scale));
    }
    applied_.push_back(std::move(a));
  }
  } catch (...) {
    restore();
    throw;
  }
  key_ = key;
  files_ = std::move(files);
  last_apply_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return true;
}

}  // namespace diffract::adapters
