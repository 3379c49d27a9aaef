#include "core/io/diffusers_folder.h"

#include "core/io/json_file.h"
#include "core/util/error.h"

namespace diffract::io {

namespace fs = std::filesystem;

std::optional<fs::path> find_weights(const fs::path& dir, const std::string& variant, std::string* chosen) {
  static const std::string kStems[] = {"diffusion_pytorch_model", "model"};
  auto candidates = [&](const std::string& v) {
    std::vector<fs::path> out;
    const std::string mid = v.empty() ? "" : "." + v;
    for (const auto& stem : kStems) {
      out.push_back(dir / (stem + mid + ".safetensors"));
      out.push_back(dir / (stem + ".safetensors.index" + mid + ".json"));
      out.push_back(dir / (stem + mid + ".safetensors.index.json"));
    }
    for (const auto& stem : kStems) out.push_back(dir / (stem + mid + ".bin"));
    out.push_back(dir / ("pytorch_model" + mid + ".bin"));
    return out;
  };
  std::vector<std::string> order = {variant};
  if (!variant.empty()) order.push_back("");
  else order.push_back("fp16");
  for (const auto& v : order)
    for (const auto& p : candidates(v))
      if (fs::is_regular_file(p)) {
        if (chosen) *chosen = v;
        return p;
      }
  return std::nullopt;
}

std::filesystem::path require_weights(const fs::path& dir, const std::string& variant) {
  if (auto w = find_weights(dir, variant)) return *w;
  const std::string v = variant.empty() ? "" : "." + variant;
  throw Error(dir.string() + ": no weight file (diffusion_pytorch_model" + v + ".safetensors, model" + v +
              ".safetensors, their sharded indexes or .bin files" + (variant.empty() ? ", or the fp16 variants" : "") + ")");
}

namespace {

Component::Kind kind_of(const std::string& name, const std::string& class_name) {
  if (name.rfind("scheduler", 0) == 0 || class_name.find("Scheduler") != std::string::npos)
    return Component::Kind::Scheduler;
  if (name.rfind("tokenizer", 0) == 0 || class_name.find("Tokenizer") != std::string::npos)
    return Component::Kind::Tokenizer;
  if (name == "feature_extractor" || name == "safety_checker" || name == "image_encoder")
    return Component::Kind::Other;
  return Component::Kind::Model;
}

void inspect(Component& c, const std::string& variant) {
  if (!fs::is_directory(c.dir)) {
    c.problem = "folder " + c.dir.filename().string() + "/ is missing";
    return;
  }
  switch (c.kind) {
    case Component::Kind::Scheduler:
      c.config = c.dir / "scheduler_config.json";
      if (!fs::is_regular_file(c.config)) c.problem = "no scheduler_config.json";
      break;
    case Component::Kind::Tokenizer: {
      const bool bpe = fs::is_regular_file(c.dir / "vocab.json") && fs::is_regular_file(c.dir / "merges.txt");
      const bool fast = fs::is_regular_file(c.dir / "tokenizer.json");
      const bool spm = fs::is_regular_file(c.dir / "spiece.model") || fs::is_regular_file(c.dir / "tokenizer.model");
      if (!bpe && !fast && !spm) c.problem = "no tokenizer files (vocab.json + merges.txt, tokenizer.json or spiece.model)";
      if (fs::is_regular_file(c.dir / "tokenizer_config.json")) c.config = c.dir / "tokenizer_config.json";
      break;
    }
    case Component::Kind::Model: {
      c.config = c.dir / "config.json";
      if (!fs::is_regular_file(c.config)) {
        c.problem = "no config.json";
        break;
      }
      auto w = find_weights(c.dir, variant, &c.variant);
      if (!w) c.problem = "no weight file (diffusion_pytorch_model/model .safetensors or .bin)";
      else c.weights = *w;
      break;
    }
    case Component::Kind::Other:
      break;
  }
  c.present = c.problem.empty();
}

}  // namespace

DiffusersFolder DiffusersFolder::open(const fs::path& root, const std::string& variant) {
  if (!fs::exists(root)) throw Error(root.string() + ": no such file or folder");
  if (!fs::is_directory(root)) throw Error(root.string() + ": not a folder (a diffusers model is a folder with model_index.json)");
  const auto index_path = root / "model_index.json";
  if (!fs::is_regular_file(index_path))
    throw Error(root.string() + ": not a diffusers model folder: no model_index.json");
  const auto index = JsonFile::read(index_path);

  DiffusersFolder folder;
  folder.root_ = root;
  folder.pipeline_class_ = index.required<std::string>("_class_name");
  for (const auto& [name, value] : index.json().items()) {
    if (name.empty() || name[0] == '_') continue;
    if (!value.is_array() || value.size() != 2) continue;  // plain settings such as requires_safety_checker
    if (value[0].is_null() || value[1].is_null()) continue;  // component deliberately absent
    if (!value[0].is_string() || !value[1].is_string())
      throw Error(index_path.string() + ": component '" + name + "' must be [library, class]");
    Component c;
    c.name = name;
    c.library = value[0].get<std::string>();
    c.class_name = value[1].get<std::string>();
    c.kind = kind_of(name, c.class_name);
    c.dir = root / name;
    inspect(c, variant);
    folder.components_.push_back(std::move(c));
  }
  return folder;
}

const Component* DiffusersFolder::find(const std::string& name) const {
  for (const auto& c : components_)
    if (c.name == name) return &c;
  return nullptr;
}

const Component& DiffusersFolder::require(const std::string& name) const {
  const auto* c = find(name);
  if (!c) throw Error(root_.string() + ": model_index.json lists no '" + name + "' component");
  if (!c->present) throw Error(root_.string() + ": component '" + name + "' is unusable: " + c->problem);
  return *c;
}

std::string DiffusersFolder::summary() const {
  std::string s = root_.string() + " (" + pipeline_class_ + ")";
  for (const auto& c : components_) {
    s += "\n  " + c.name + " [" + c.class_name + "]: ";
    if (!c.present) s += "MISSING: " + c.problem;
    else if (!c.weights.empty()) s += c.weights.filename().string();
    else s += "ok";
  }
  return s;
}

}  // namespace diffract::io
