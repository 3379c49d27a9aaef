#include "core/io/lora_file.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <regex>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "core/io/json_file.h"
#include "core/io/safetensors.h"
#include "core/util/error.h"

#ifdef DIFFRACT_HAS_OPENSSL
#include <openssl/evp.h>
#endif

namespace diffract::io {

namespace fs = std::filesystem;

int64_t LoraLayer::rank() const {
  const auto get = [&](const char* k) -> const at::Tensor* {
    const auto it = tensors.find(k);
    return it == tensors.end() ? nullptr : &it->second;
  };
  if (kind == LoraKind::LoRA) return get("down")->size(0);
  if (kind == LoraKind::LoHa) return get("w1_b")->size(0);
  if (const auto* t = get("w1_b")) return t->size(0);
  if (const auto* t = get("w2_b")) return t->size(0);
  return 0;
}

double LoraLayer::scale(double weight) const {
  const auto r = rank();
  return alpha && r > 0 ? weight * *alpha / static_cast<double>(r) : weight;
}

namespace {

std::string underscored(std::string s) {
  std::replace(s.begin(), s.end(), '.', '_');
  return s;
}

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }

// The suffix naming a tensor's role: kohya / LyCORIS / PEFT spellings to ours.
struct Role {
  const char* suffix;
  const char* name;
  LoraKind kind;
};
const Role kRoles[] = {
    {".lora_down.weight", "down", LoraKind::LoRA}, {".lora_up.weight", "up", LoraKind::LoRA},
    {".lora_mid.weight", "mid", LoraKind::LoRA},   {".lora_A.default.weight", "down", LoraKind::LoRA},
    {".lora_B.default.weight", "up", LoraKind::LoRA}, {".lora_A.weight", "down", LoraKind::LoRA},
    {".lora_B.weight", "up", LoraKind::LoRA},      {".lora.down.weight", "down", LoraKind::LoRA},
    {".lora.up.weight", "up", LoraKind::LoRA},     {".hada_w1_a", "w1_a", LoraKind::LoHa},
    {".hada_w1_b", "w1_b", LoraKind::LoHa},        {".hada_w2_a", "w2_a", LoraKind::LoHa},
    {".hada_w2_b", "w2_b", LoraKind::LoHa},        {".hada_t1", "t1", LoraKind::LoHa},
    {".hada_t2", "t2", LoraKind::LoHa},            {".lokr_w1_a", "w1_a", LoraKind::LoKr},
    {".lokr_w1_b", "w1_b", LoraKind::LoKr},        {".lokr_w2_a", "w2_a", LoraKind::LoKr},
    {".lokr_w2_b", "w2_b", LoraKind::LoKr},        {".lokr_w1", "w1", LoraKind::LoKr},
    {".lokr_w2", "w2", LoraKind::LoKr},            {".lokr_t2", "t2", LoraKind::LoKr},
};

// Where a file's layer name points: the component and the module name in the file's spelling.
struct Prefix {
  const char* prefix;
  const char* component;
  bool underscored;
};
const Prefix kPrefixes[] = {
    {"lora_unet_", "unet", true},          {"lora_te1_", "text_encoder", true},
    {"lora_te2_", "text_encoder_2", true}, {"lora_te_", "text_encoder", true},
    {"lora_transformer_", "transformer", true}, {"unet.", "unet", false},
    {"text_encoder_2.", "text_encoder_2", false}, {"text_encoder.", "text_encoder", false},
    {"transformer.", "transformer", false},
};

// Per component: the file's spelling of a module -> ours.
using Lookup = std::map<std::string, std::string>;

Lookup lookup_for(const std::string& component, const std::map<std::string, std::vector<int64_t>>& modules) {
  Lookup l;
  std::vector<std::string> names;
  for (const auto& [name, shape] : modules) names.push_back(name);
  for (const auto& name : names) {
    l.emplace(name, name);
    l.emplace(underscored(name), name);
    // transformers 5 names CLIP's modules without "text_model." (and PEFT files made with it do too).
    if (starts_with(name, "text_model.")) {
      l.emplace(name.substr(11), name);
      l.emplace(underscored(name.substr(11)), name);
    }
  }
  if (component == "unet")
    for (const auto& [ours, ldm] : ldm_unet_module_names(names)) {
      l.emplace(ldm, ours);
      l.emplace(underscored(ldm), ours);
    }
  return l;
}

std::string shape_text(at::IntArrayRef s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}
std::string shape_text(const std::vector<int64_t>& s) { return shape_text(at::IntArrayRef(s)); }

// The shape the layer's update takes (rows = the weight's first dimension, the rest flattened).
std::pair<int64_t, int64_t> update_shape(const LoraLayer& l, const std::string& file) {
  const auto& t = l.tensors;
  const auto need = [&](const char* k) -> const at::Tensor& {
    const auto it = t.find(k);
    if (it == t.end())
      throw Error(file + ": layer '" + l.source + "' lacks its " + k + " tensor");
    return it->second;
  };
  switch (l.kind) {
    case LoraKind::LoRA: {
      const auto& down = need("down");
      const auto& up = need("up");
      if ((down.dim() != 2 && down.dim() != 4) || (up.dim() != 2 && up.dim() != 4) || up.size(1) != down.size(0))
        throw Error(file + ": layer '" + l.source + "' has down " + shape_text(down.sizes()) + " and up " +
                    shape_text(up.sizes()) + ", which do not multiply");
      int64_t in = down.numel() / down.size(0);
      if (const auto it = t.find("mid"); it != t.end()) in = down.size(1) * it->second.size(2) * it->second.size(3);
      return {up.size(0), in};
    }
    case LoraKind::LoHa: {
      const auto& a = need("w1_a");
      const auto& b = need("w1_b");
      if (t.count("t1")) return {a.size(1), b.size(1) * t.at("t1").size(2) * t.at("t1").size(3)};
      return {a.size(0), b.numel() / b.size(0)};
    }
    case LoraKind::LoKr: {
      const auto rows_cols = [&](const char* full, const char* fa, const char* fb) -> std::pair<int64_t, int64_t> {
        if (t.count(full)) {
          const auto& w = t.at(full);
          return {w.size(0), w.numel() / w.size(0)};
        }
        const auto& a = need(fa);
        const auto& b = need(fb);
        if (std::string(full) == "w2" && t.count("t2")) return {a.size(1), b.size(1) * t.at("t2").size(2) * t.at("t2").size(3)};
        return {a.size(0), b.numel() / b.size(0)};
      };
      const auto [r1, c1] = rows_cols("w1", "w1_a", "w1_b");
      const auto [r2, c2] = rows_cols("w2", "w2_a", "w2_b");
      return {r1 * r2, c1 * c2};
    }
  }
  return {0, 0};
}

// diffusers' lora_adapter_metadata: per component lora_alpha and alpha_pattern (a module-name
// suffix -> alpha, as PEFT matches it).
struct AlphaMetadata {
  std::map<std::string, double> lora_alpha;                            // component -> alpha
  std::map<std::string, std::map<std::string, double>> alpha_pattern;  // component -> pattern -> alpha
};

AlphaMetadata alpha_metadata(const SafetensorsArchive& archive, const std::string& file) {
  AlphaMetadata m;
  const auto it = archive.metadata().find("lora_adapter_metadata");
  if (it == archive.metadata().end()) return m;
  const auto j = parse_json(it->second, file + ": its lora_adapter_metadata");
  if (!j.is_object()) throw Error(file + ": its lora_adapter_metadata is not a JSON object");
  for (const auto& [key, value] : j.items()) {
    const auto dot = key.rfind('.');
    const auto component = dot == std::string::npos ? std::string("unet") : key.substr(0, dot);
    const auto field = dot == std::string::npos ? key : key.substr(dot + 1);
    if (field == "lora_alpha" && value.is_number()) m.lora_alpha[component] = value.get<double>();
    if (field == "alpha_pattern" && value.is_object())
      for (const auto& [pattern, a] : value.items())
        if (a.is_number()) m.alpha_pattern[component][pattern] = a.get<double>();
  }
  return m;
}

}  // namespace

// No real module name comes near this; longer ones match nothing.
constexpr std::size_t kMaxModuleName = 512;

std::map<std::string, std::string> ldm_unet_module_names(const std::vector<std::string>& modules) {
  // The block structure: per down block its resnets and whether it downsamples, per up block
  // its resnets and whether it has attentions.
  // Bounded digits and names: libstdc++'s regex recurses per matched character, and a file's key
  // can be 100 000 characters long.
  static const std::regex block(R"(^(down|up)_blocks\.(\d{1,6})\.(resnets|attentions|downsamplers|upsamplers)\.(\d{1,6})\.)");
  std::map<int, int> down_res, up_res;
  std::set<int> down_sample, up_attn;
  std::smatch m;
  for (const auto& name : modules) {
    if (name.size() > kMaxModuleName || !std::regex_search(name, m, block)) continue;
    const bool down = m[1] == "down";
    const int b = std::stoi(m[2]), i = std::stoi(m[4]);
    if (m[3] == "resnets") (down ? down_res : up_res)[b] = std::max((down ? down_res : up_res)[b], i + 1);
    if (m[3] == "downsamplers") down_sample.insert(b);
    if (down && m[3] == "attentions") down_res[b] = std::max(down_res[b], i + 1);
    if (!down && m[3] == "attentions") up_attn.insert(b), up_res[b] = std::max(up_res[b], i + 1);
  }
  const auto down_start = [&](int b) {  // input_blocks index of down block b's first resnet
    int idx = 1;
    for (int k = 0; k < b; ++k) idx += down_res[k] + (down_sample.count(k) ? 1 : 0);
    return idx;
  };
  const auto up_start = [&](int b) {
    int idx = 0;
    for (int k = 0; k < b; ++k) idx += up_res[k];
    return idx;
  };
  static const std::map<std::string, std::string> resnet_parts = {
      {"norm1", "in_layers.0"}, {"conv1", "in_layers.2"}, {"time_emb_proj", "emb_layers.1"},
      {"norm2", "out_layers.0"}, {"conv2", "out_layers.3"}, {"conv_shortcut", "skip_connection"}};
  static const std::map<std::string, std::string> fixed = {
      {"conv_in", "input_blocks.0.0"},          {"time_embedding.linear_1", "time_embed.0"},
      {"time_embedding.linear_2", "time_embed.2"}, {"add_embedding.linear_1", "label_emb.0.0"},
      {"add_embedding.linear_2", "label_emb.0.2"}, {"conv_norm_out", "out.0"},
      {"conv_out", "out.2"}};
  const auto resnet_rest = [&](const std::string& rest) -> std::string {
    const auto dot = rest.find('.');
    const auto head = rest.substr(0, dot);
    const auto it = resnet_parts.find(head);
    if (it == resnet_parts.end()) return "";
    return it->second + (dot == std::string::npos ? "" : rest.substr(dot));
  };
  static const std::regex part(R"(^(down_blocks|up_blocks|mid_block)\.(?:(\d{1,6})\.)?(resnets|attentions|downsamplers|upsamplers)\.(\d{1,6})\.(.+)$)");
  std::map<std::string, std::string> out;
  for (const auto& name : modules) {
    if (const auto f = fixed.find(name); f != fixed.end()) {
      out[name] = f->second;
      continue;
    }
    if (name.size() > kMaxModuleName || !std::regex_match(name, m, part)) continue;
    const std::string where = m[1], kind = m[3], rest = m[5];
    const int b = m[2].matched ? std::stoi(m[2]) : 0, i = std::stoi(m[4]);
    std::string ldm;
    if (where == "mid_block") {
      if (kind == "resnets") {
        const auto r = resnet_rest(rest);
        if (!r.empty()) ldm = "middle_block." + std::to_string(i == 0 ? 0 : 2) + "." + r;
      } else if (kind == "attentions") {
        ldm = "middle_block.1." + rest;
      }
    } else if (where == "down_blocks") {
      const int idx = down_start(b) + i;
      if (kind == "resnets") {
        const auto r = resnet_rest(rest);
        if (!r.empty()) ldm = "input_blocks." + std::to_string(idx) + ".0." + r;
      } else if (kind == "attentions") {
        ldm = "input_blocks." + std::to_string(idx) + ".1." + rest;
      } else if (kind == "downsamplers" && rest == "conv") {
        ldm = "input_blocks." + std::to_string(down_start(b) + down_res[b]) + ".0.op";
      }
    } else {
      const int idx = up_start(b) + i;
      if (kind == "resnets") {
        const auto r = resnet_rest(rest);
        if (!r.empty()) ldm = "output_blocks." + std::to_string(idx) + ".0." + r;
      } else if (kind == "attentions") {
        ldm = "output_blocks." + std::to_string(idx) + ".1." + rest;
      } else if (kind == "upsamplers" && rest == "conv") {
        ldm = "output_blocks." + std::to_string(up_start(b) + up_res[b] - 1) + (up_attn.count(b) ? ".2" : ".1") + ".conv";
      }
    }
    if (!ldm.empty()) out[name] = ldm;
  }
  return out;
}

std::string lora_file_hash(const fs::path& file) {
#ifdef DIFFRACT_HAS_OPENSSL
  std::ifstream in(file, std::ios::binary);
  std::uint8_t head[8] = {};
  if (!in.read(reinterpret_cast<char*>(head), 8)) throw Error(file.string() + ": too short to be a .safetensors file");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | head[i];
  in.seekg(static_cast<std::streamoff>(8 + n));
  if (!in) throw Error(file.string() + ": its header runs past the end of the file");
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    if (in.gcount() > 0) EVP_DigestUpdate(ctx, buffer.data(), static_cast<std::size_t>(in.gcount()));
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(ctx, digest, &length);
  EVP_MD_CTX_free(ctx);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < length; ++i) out += {hex[digest[i] >> 4], hex[digest[i] & 15]};
  return out;
#else
  (void)file;
  return "";
#endif
}

ResolvedLora resolve_lora(const fs::path& path, const LoraModelModules& model) {
  const auto file = path.string();
  if (!fs::is_regular_file(path)) throw Error("LoRA file " + file + " does not exist");
  if (path.extension() != ".safetensors")
    throw Error("LoRA file " + file + " is not a .safetensors file (pickled .pt / .ckpt LoRAs are not read)");
  const auto archive = SafetensorsArchive::open(path);
  const auto alphas = alpha_metadata(*archive, file);

  // Group the tensors by layer.
  struct Pending {
    LoraLayer layer;
    bool kind_set = false;
  };
  std::map<std::string, Pending> layers;
  std::vector<std::string> unknown;
  for (const auto& info : archive->tensors()) {
    const auto& key = info.name;
    bool placed = false;
    for (const auto& r : kRoles) {
      const std::string suffix = r.suffix;
      if (key.size() <= suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
      const auto source = key.substr(0, key.size() - suffix.size());
      auto& p = layers[source];
      if (p.kind_set && p.layer.kind != r.kind)
        throw Error(file + ": layer '" + source + "' mixes LoRA, LoHa and LoKr tensors");
      p.layer.source = source;
      p.layer.kind = r.kind;
      p.kind_set = true;
      p.layer.tensors[r.name] = to_tensor(archive, info);  // as stored: converted on the device
      placed = true;
      break;
    }
    if (placed) continue;
    const std::string alpha = ".alpha";
    if (key.size() > alpha.size() && key.compare(key.size() - alpha.size(), alpha.size(), alpha) == 0) {
      const auto t = to_tensor(archive, info);
      if (t.numel() != 1) throw Error(file + ": '" + key + "' should hold one number, it holds " + shape_text(t.sizes()));
      layers[key.substr(0, key.size() - alpha.size())].layer.alpha = t.to(at::kDouble).item<double>();
      continue;
    }
    unknown.push_back(key);
  }
  // Alphas without tensors (a layer of only ".alpha") are left out below; unknown keys decide.
  if (!unknown.empty()) {
    const bool checkpoint = std::any_of(unknown.begin(), unknown.end(), [](const std::string& k) {
      return starts_with(k, "model.diffusion_model.") || starts_with(k, "first_stage_model.") ||
             starts_with(k, "conditioner.") || starts_with(k, "cond_stage_model.");
    });
    if (checkpoint) throw Error(file + " is a model checkpoint, not a LoRA: load it as the model");
    std::string list;
    for (std::size_t i = 0; i < unknown.size() && i < 5; ++i) list += (i ? ", " : "") + unknown[i];
    if (unknown.size() > 5) list += " and " + std::to_string(unknown.size() - 5) + " more";
    const bool none = std::none_of(layers.begin(), layers.end(), [](const auto& p) { return p.second.kind_set; });
    if (none) throw Error(file + " is not a LoRA: it has no lora_down / lora_up, lora_A / lora_B, hada_ or lokr_ tensors (" + list + ")");
    throw Error(file + ": keys of no known LoRA kind (DoRA's dora_scale, full .diff layers and bias updates are not read): " + list);
  }

  ResolvedLora out;
  out.path = path;
  out.hash = lora_file_hash(path).substr(0, 12);
  std::map<std::string, Lookup> lookups;
  bool kohya = false, lycoris = false;
  for (auto& [source, p] : layers) {
    if (!p.kind_set) continue;  // an alpha alone
    auto& l = p.layer;
    const Prefix* prefix = nullptr;
    for (const auto& x : kPrefixes)
      if (starts_with(source, x.prefix)) {
        prefix = &x;
        break;
      }
    if (!prefix) {
      out.unmatched.push_back(source);
      continue;
    }
    kohya = kohya || prefix->underscored;
    lycoris = lycoris || l.kind != LoraKind::LoRA || l.tensors.count("mid");
    l.component = prefix->component;
    const auto comp = model.components.find(l.component);
    if (comp == model.components.end()) {
      out.unmatched.push_back(source);
      continue;
    }
    auto& lookup = lookups[l.component];
    if (lookup.empty()) lookup = lookup_for(l.component, comp->second);
    const auto name = source.substr(std::string(prefix->prefix).size());
    auto hit = lookup.find(name);
    if (hit == lookup.end() && !prefix->underscored) hit = lookup.find(underscored(name));
    if (hit == lookup.end()) {
      out.unmatched.push_back(source);
      continue;
    }
    l.module = hit->second;
    const auto& shape = comp->second.at(l.module);
    int64_t numel = 1;
    for (const auto s : shape) numel *= s;
    const auto [rows, cols] = update_shape(l, file);
    if (rows != shape[0] || rows * cols != numel)
      throw Error(file + ": layer '" + source + "' makes an update of " + std::to_string(rows) + " x " +
                  std::to_string(cols) + " for " + l.component + " " + l.module + ", whose weight is " + shape_text(shape) +
                  ": the LoRA is for another model (family or size)");
    if (!l.alpha && !prefix->underscored) {
      const auto& pats = alphas.alpha_pattern;
      if (const auto pc = pats.find(l.component); pc != pats.end())
        for (const auto& [pattern, a] : pc->second)
          if (l.module == pattern || (l.module.size() > pattern.size() &&
                                      l.module.compare(l.module.size() - pattern.size(), pattern.size(), pattern) == 0 &&
                                      l.module[l.module.size() - pattern.size() - 1] == '.'))
            l.alpha = a;
      if (!l.alpha)
        if (const auto la = alphas.lora_alpha.find(l.component); la != alphas.lora_alpha.end()) l.alpha = la->second;
    }
    out.per_component[l.component]++;
    out.layers.push_back(std::move(l));
  }
  if (out.layers.empty() && out.unmatched.empty()) throw Error(file + " is not a LoRA: it holds no layers");
  out.format = lycoris ? "lycoris" : kohya ? "kohya" : "diffusers";
  return out;
}

}  // namespace diffract::io
