#include "core/io/single_file.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <iterator>
#include <cmath>
#include <tuple>
#include <map>
#include <set>

#include "core/io/key_maps.h"
#include "core/io/safetensors.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/square_side.h"

namespace diffract::io {

namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// "N.rest" -> N and rest. False unless `s` starts with digits and a dot.
bool take_index(const std::string& s, int64_t& index, std::string& rest) {
  std::size_t digits = 0;
  while (digits < s.size() && std::isdigit(static_cast<unsigned char>(s[digits]))) ++digits;
  if (digits == 0 || digits > 9 || digits >= s.size() || s[digits] != '.') return false;
  index = std::stoll(s.substr(0, digits));
  rest = s.substr(digits + 1);
  return true;
}

// "head.N.rest" -> N and rest.
bool take_index(const std::string& s, const std::string& head, int64_t& index, std::string& rest) {
  return starts_with(s, head) && take_index(s.substr(head.size()), index, rest);
}

const std::string& name_of(const StateDict::value_type& entry) { return entry.first; }
const std::string& name_of(const TensorShape* tensor) { return tensor->name; }

// The distinct N of names "head.N.*" among `entries` (a state dict, or an index's range), ascending.
template <typename Entries>
std::set<int64_t> indices(const Entries& entries, const std::string& head) {
  std::set<int64_t> out;
  int64_t n = 0;
  std::string rest;
  for (const auto& entry : entries)
    if (take_index(name_of(entry), head, n, rest)) out.insert(n);
  return out;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The tensors under `prefix`, with the prefix removed.
StateDict strip(const StateDict& all, const std::string& prefix) {
  StateDict out;
  for (auto it = all.lower_bound(prefix); it != all.end() && starts_with(it->first, prefix); ++it)
    out.emplace(it->first.substr(prefix.size()), it->second);
  return out;
}

// Inside a UNet resnet: LDM ResBlock names -> diffusers' ResnetBlock2D names. Empty when unknown.
std::string unet_resnet(const std::string& rest) {
  static const std::pair<const char*, const char*> names[] = {
      {"in_layers.0.", "norm1."},         {"in_layers.2.", "conv1."}, {"emb_layers.1.", "time_emb_proj."},
      {"out_layers.0.", "norm2."},        {"out_layers.3.", "conv2."}, {"skip_connection.", "conv_shortcut."}};
  for (const auto& [ldm, ours] : names)
    if (starts_with(rest, ldm)) return ours + rest.substr(std::string(ldm).size());
  return {};
}

// A 1x1 convolution's weight as the equivalent Linear weight ([out, in, 1, 1] or [out, in, 1] -> [out, in]).
at::Tensor as_linear(const at::Tensor& t) {
  if (t.dim() <= 2) return t;
  for (int64_t d = 2; d < t.dim(); ++d)
    if (t.size(d) != 1) return t;  // not a 1x1 conv: left for bind() to report as a shape mismatch
  return t.reshape({t.size(0), t.size(1)});
}

// A file's tensors sorted by name, and the lookups detection makes on them. It points into the
// list it was made from (no name or shape is copied: detection runs on every file a user opens,
// and a fuzzer runs it millions of times). A name given twice keeps its first tensor.
class ShapeIndex {
 public:
  using Entries = std::vector<const TensorShape*>;
  struct Range {
    Entries::const_iterator first, last;
    Entries::const_iterator begin() const { return first; }
    Entries::const_iterator end() const { return last; }
  };

  explicit ShapeIndex(const std::vector<TensorShape>& tensors) {
    sorted_.reserve(tensors.size());
    for (const auto& t : tensors) sorted_.push_back(&t);
    const auto by_name = [](const TensorShape* a, const TensorShape* b) { return a->name < b->name; };
    if (!std::is_sorted(sorted_.begin(), sorted_.end(), by_name))  // most files list their tensors in order
      std::stable_sort(sorted_.begin(), sorted_.end(), by_name);
    const auto same_name = [](const TensorShape* a, const TensorShape* b) { return a->name == b->name; };
    sorted_.erase(std::unique(sorted_.begin(), sorted_.end(), same_name), sorted_.end());
  }
  bool empty() const { return sorted_.empty(); }
  Entries::const_iterator begin() const { return sorted_.begin(); }
  Entries::const_iterator end() const { return sorted_.end(); }

  // The shape of tensor `key`, or null.
  const std::vector<int64_t>* find(const std::string& key) const {
    const auto it = lower_bound(key);
    return it != sorted_.end() && (*it)->name == key ? &(*it)->shape : nullptr;
  }
  bool has(const std::string& key) const { return find(key) != nullptr; }
  const std::vector<int64_t>& at(const std::string& key) const {
    if (const auto* shape = find(key)) return *shape;
    throw Error("no tensor '" + key + "'");
  }
  // The tensors whose names start with `prefix`, in name order.
  Range with_prefix(const std::string& prefix) const {
    const auto first = lower_bound(prefix);
    const auto last = std::partition_point(first, sorted_.end(),
                                           [&](const TensorShape* t) { return starts_with(t->name, prefix); });
    return {first, last};
  }
  std::string first_with_prefix(const std::string& prefix) const {
    const auto range = with_prefix(prefix);
    return range.first != range.last ? (*range.first)->name : std::string();
  }
  bool any_prefix(const std::string& prefix) const { return !first_with_prefix(prefix).empty(); }

 private:
  Entries::const_iterator lower_bound(const std::string& key) const {
    return std::lower_bound(sorted_.begin(), sorted_.end(), key,
                            [](const TensorShape* t, const std::string& k) { return t->name < k; });
  }
  Entries sorted_;
};

// The distinct N of the index's names "head.N.*", ascending.
std::set<int64_t> indices(const ShapeIndex& index, const std::string& head) {
  return indices(index.with_prefix(head), head);
}

std::string family_guess(int64_t context_dim, bool label_emb) {
  if (label_emb || context_dim == 2048) return "SDXL-like";
  if (context_dim == 768) return "SD 1.x-like";
  if (context_dim == 1024) return "SD 2.x-like";
  return "SD-like";
}

}  // namespace

std::string single_file_family_name(SingleFileFamily family) {
  switch (family) {
    case SingleFileFamily::SD1: return "SD 1.x";
    case SingleFileFamily::SD2: return "SD 2.x";
    case SingleFileFamily::SDXL: return "SDXL";
  }
  return "?";
}

std::vector<TensorShape> tensor_shapes(const SafetensorsArchive& archive) {
  std::vector<TensorShape> out;
  out.reserve(archive.tensors().size());
  for (const auto& t : archive.tensors())
    out.push_back({t.name, t.shape, t.dtype == DType::F8_E4M3 || t.dtype == DType::F8_E5M2});
  return out;
}

std::vector<TensorShape> tensor_shapes(const StateDict& weights) {
  std::vector<TensorShape> out;
  out.reserve(weights.size());
  for (const auto& [name, t] : weights)
    out.push_back({name, t.sizes().vec(),
                   t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2});
  return out;
}

// --- detection ---------------------------------------------------------------------------------

SingleFileLayout detect_single_file(const SafetensorsArchive& archive) {
  return detect_single_file(tensor_shapes(archive), archive.path().string());
}

SingleFileLayout detect_single_file(const std::vector<TensorShape>& tensors, const std::string& what) {
  const ShapeIndex index(tensors);
  const auto any_contains = [&](const std::string& part) {
    for (const TensorShape* t : index)
      if (t->name.find(part) != std::string::npos) return t->name;
    return std::string();
  };
  const std::string supported = "; only Stable Diffusion 1.x, 2.x and SDXL base single files are supported";
  const auto unsupported = [&](const std::string& found) { throw Error(what + ": " + found + supported); };

  if (index.empty()) throw Error(what + ": holds no tensors, so it is no Stable Diffusion checkpoint");

  // Other architectures, recognised by their distinctive keys.
  // SD3 files load through the SD3 pipeline (detect_sd3_single_file); reaching here means a caller
  // took one for an SD / SDXL file.
  const std::string sd3_hint = "; it loads through the SD3 pipeline (StableDiffusion3, which load_pipeline picks)";
  if (auto k = any_contains("joint_blocks."); !k.empty())
    throw Error(what + ": an SD3 / SD3.5 (MMDiT) checkpoint (found '" + k + "'), not an SD 1.x / 2.x / SDXL one" +
                sd3_hint);
  if (auto k = any_contains("double_blocks."); !k.empty())
    throw Error(what + ": a FLUX checkpoint (found '" + k + "'), not an SD 1.x / 2.x / SDXL one; FLUX single files "
                "load as .safetensors through the Flux pipeline (which load_pipeline picks)");
  if (auto k = index.first_with_prefix("text_encoders."); !k.empty())
    throw Error(what + ": an SD3-style checkpoint with text_encoders.* (found '" + k + "') but no MMDiT " +
                "(joint_blocks.*); only Stable Diffusion 1.x, 2.x, SDXL base, SD3 / SD3.5 and FLUX.1 single files are "
                "supported");
  if (auto k = index.first_with_prefix("control_model."); !k.empty()) unsupported("a ControlNet (found '" + k + "')");
  if (index.has("edm_mean") || index.has("edm_std")) unsupported("a Playground v2.5 (EDM) checkpoint (found 'edm_mean')");
  if (index.has("conditioner.embedders.0.model.token_embedding.weight") && !index.has("conditioner.embedders.1.model.token_embedding.weight"))
    unsupported("an SDXL refiner (only OpenCLIP-bigG, at conditioner.embedders.0.model.)");

  SingleFileLayout layout;
  const std::string& unet = layout.unet_prefix;
  const std::string& vae = layout.vae_prefix;
  const bool has_unet = index.has(unet + "input_blocks.0.0.weight");
  if (!has_unet && index.any_prefix(unet))
    unsupported("its UNet keys are not the LDM / SGM layout (found '" + index.first_with_prefix(unet) +
                "', but no '" + unet + "input_blocks.0.0.weight')");
  const bool has_vae = index.has(vae + "encoder.conv_in.weight") && index.has(vae + "decoder.conv_in.weight");
  const bool sd1_clip = index.has("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight") ||
                        index.has("cond_stage_model.transformer.embeddings.token_embedding.weight");
  const bool sd2_clip = index.has("cond_stage_model.model.token_embedding.weight");
  const bool xl_l = index.has("conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight");
  const bool xl_g = index.has("conditioner.embedders.1.model.token_embedding.weight");

  if (!has_unet && !index.any_prefix(vae) && !index.any_prefix("cond_stage_model.") && !index.any_prefix("conditioner.")) {
    std::string found;
    if (index.has("conv_in.weight") && index.any_prefix("down_blocks."))
      found = "a diffusers-layout state dict (conv_in, down_blocks.*): load its diffusers folder instead";
    else
      found = "none of model.diffusion_model.*, first_stage_model.*, cond_stage_model.* or conditioner.* (first key '" +
              (*index.begin())->name + "')";
    throw Error(what + ": not a Stable Diffusion single-file checkpoint: " + found);
  }

  // The UNet's shape facts.
  const bool label_emb = index.has(unet + "label_emb.0.0.weight");
  int64_t context_dim = 0;
  for (const TensorShape* t : index.with_prefix(unet))
    if (ends_with(t->name, ".attn2.to_k.weight") && t->shape.size() == 2) {
      context_dim = t->shape[1];
      break;
    }

  // Which text encoders are there decides the family.
  std::vector<std::string> missing;
  std::string family_text;
  if (xl_l || xl_g) {
    layout.family = SingleFileFamily::SDXL;
    family_text = "SDXL";
    if (!xl_l) missing.push_back("the CLIP-L text encoder (conditioner.embedders.0.transformer.text_model.*)");
    if (!xl_g) missing.push_back("the OpenCLIP-bigG text encoder (conditioner.embedders.1.model.*)");
  } else if (sd2_clip) {
    layout.family = SingleFileFamily::SD2;
    family_text = "SD 2.x";
  } else if (sd1_clip) {
    layout.family = SingleFileFamily::SD1;
    family_text = "SD 1.x";
  } else {
    family_text = has_unet ? family_guess(context_dim, label_emb) : "SD-like";
    missing.push_back("a text encoder (cond_stage_model.* or conditioner.embedders.*)");
  }
  if (!has_unet) missing.insert(missing.begin(), "the UNet (" + unet + "input_blocks.*, ...)");
  if (!has_vae) missing.insert(missing.begin() + (has_unet ? 0 : 1), "the VAE (" + vae + "encoder.*, decoder.*)");
  if (!missing.empty()) {
    std::string msg = what + ": incomplete " + family_text + " single-file checkpoint: it lacks ";
    for (std::size_t i = 0; i < missing.size(); ++i) msg += (i ? (i + 1 == missing.size() ? " and " : ", ") : "") + missing[i];
    msg += ". A single file must hold UNet, VAE and text encoder(s); a diffusers folder can combine parts";
    throw Error(msg);
  }

  // UNet variants of the same families that this engine does not run.
  const auto& conv_in = index.at(unet + "input_blocks.0.0.weight");
  const int64_t in_channels = conv_in.size() == 4 ? conv_in[1] : -1;
  if (index.has(unet + "label_emb.weight")) unsupported("an x4 upscaler UNet (label_emb.weight: noise-level classes)");
  if (in_channels == 9) unsupported("an inpainting " + family_text + " UNet (9 input channels)");
  if (in_channels == 8) unsupported("an instruct-pix2pix " + family_text + " UNet (8 input channels)");
  if (in_channels != 4)
    unsupported("a UNet whose input convolution is " + shape_str(conv_in) + " (4 latent channels expected)");
  if (label_emb && layout.family != SingleFileFamily::SDXL)
    unsupported("a " + family_text + " UNet with label_emb (unCLIP / class-conditioned)");
  if (!label_emb && layout.family == SingleFileFamily::SDXL)
    throw Error(what + ": SDXL text encoders, but the UNet has no label_emb.0.0.weight (the added text/time "
                "conditioning every SDXL UNet has)");
  if (context_dim == 0) throw Error(what + ": the UNet has no cross-attention (no *.attn2.to_k.weight)");

  // The text encoders must produce what the UNet attends to.
  const auto width = [&](const std::string& key) { return index.at(key).size() == 2 ? index.at(key)[1] : -1; };
  int64_t text_width = 0;
  switch (layout.family) {
    case SingleFileFamily::SD1:
      layout.text_encoder_prefix = "cond_stage_model.transformer.";
      text_width = index.has("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight")
                       ? width("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight")
                       : width("cond_stage_model.transformer.embeddings.token_embedding.weight");
      break;
    case SingleFileFamily::SD2:
      layout.text_encoder_prefix = "cond_stage_model.model.";
      layout.text_encoder_open_clip = true;
      text_width = width("cond_stage_model.model.token_embedding.weight");
      break;
    case SingleFileFamily::SDXL:
      layout.text_encoder_prefix = "conditioner.embedders.0.transformer.";
      layout.text_encoder_2_prefix = "conditioner.embedders.1.model.";
      text_width = width("conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight") +
                   width("conditioner.embedders.1.model.token_embedding.weight");
      break;
  }
  if (text_width != context_dim)
    throw Error(what + ": the UNet attends to " + std::to_string(context_dim) + "-wide text features but the " +
                family_text + " text encoder(s) give " + std::to_string(text_width) +
                " (mixed-up components?)");
  const std::string open_clip =
      layout.text_encoder_open_clip ? layout.text_encoder_prefix : layout.text_encoder_2_prefix;
  if (!open_clip.empty()) {
    layout.open_clip_blocks = static_cast<int64_t>(indices(index, open_clip + "transformer.resblocks.").size());
    if (layout.open_clip_blocks == 0)
      throw Error(what + ": the OpenCLIP text encoder at " + open_clip + " has no transformer.resblocks.*");
  }
  layout.context_dim = context_dim;
  layout.v_prediction_hint = index.has("v_pred");
  log::get("io").debug(log::str(what, ": ", family_text, " single-file checkpoint, context ", context_dim));
  return layout;
}

// --- key mapping -------------------------------------------------------------------------------

StateDict map_ldm_unet(const StateDict& all, const std::string& prefix) {
  const StateDict ldm = strip(all, prefix);
  if (ldm.empty()) throw Error("no UNet tensors under '" + prefix + "'");

  // Down path: a resnet (with its attention as sub-module 1) per input block; a downsampler ("op")
  // closes a down block.
  struct Slot {
    int64_t block = 0, layer = 0;
    bool sampler = false;
  };
  std::map<int64_t, Slot> inputs, outputs;
  {
    int64_t block = 0, layer = 0;
    for (auto i : indices(ldm, "input_blocks.")) {
      if (i == 0) continue;
      if (ldm.count("input_blocks." + std::to_string(i) + ".0.op.weight")) {
        inputs[i] = {block, 0, true};
        ++block;
        layer = 0;
      } else {
        inputs[i] = {block, layer++, false};
      }
    }
  }
  // Up path: a resnet (+ attention) per output block; the one with an upsampler ("conv" as
  // sub-module 1, or 2 after an attention) closes an up block.
  {
    int64_t block = 0, layer = 0;
    for (auto i : indices(ldm, "output_blocks.")) {
      const std::string head = "output_blocks." + std::to_string(i);
      const bool up = ldm.count(head + ".1.conv.weight") || ldm.count(head + ".2.conv.weight");
      outputs[i] = {block, layer, up};
      if (up) {
        ++block;
        layer = 0;
      } else {
        ++layer;
      }
    }
  }

  static const std::pair<const char*, const char*> fixed[] = {
      {"time_embed.0.", "time_embedding.linear_1."}, {"time_embed.2.", "time_embedding.linear_2."},
      {"label_emb.0.0.", "add_embedding.linear_1."}, {"label_emb.0.2.", "add_embedding.linear_2."},
      {"input_blocks.0.0.", "conv_in."},             {"out.0.", "conv_norm_out."},
      {"out.2.", "conv_out."}};
  const auto map_key = [&](const std::string& key) -> std::string {
    for (const auto& [from, to] : fixed)
      if (starts_with(key, from)) return to + key.substr(std::string(from).size());
    int64_t i = 0, sub = 0;
    std::string rest, inner;
    if (take_index(key, "input_blocks.", i, rest) && take_index(rest, sub, inner) && inputs.count(i)) {
      const auto& s = inputs.at(i);
      const std::string block = "down_blocks." + std::to_string(s.block) + ".";
      if (s.sampler) return sub == 0 && starts_with(inner, "op.") ? block + "downsamplers.0.conv." + inner.substr(3) : "";
      if (sub == 0) {
        auto r = unet_resnet(inner);
        return r.empty() ? "" : block + "resnets." + std::to_string(s.layer) + "." + r;
      }
      return sub == 1 ? block + "attentions." + std::to_string(s.layer) + "." + inner : "";
    }
    if (take_index(key, "middle_block.", sub, inner)) {
      if (sub == 1) return "mid_block.attentions.0." + inner;
      auto r = unet_resnet(inner);
      if (r.empty() || (sub != 0 && sub != 2)) return "";
      return "mid_block.resnets." + std::to_string(sub / 2) + "." + r;
    }
    if (take_index(key, "output_blocks.", i, rest) && take_index(rest, sub, inner)) {
      const auto& s = outputs.at(i);
      const std::string block = "up_blocks." + std::to_string(s.block) + ".";
      if (sub == 0) {
        auto r = unet_resnet(inner);
        return r.empty() ? "" : block + "resnets." + std::to_string(s.layer) + "." + r;
      }
      if ((sub == 1 || sub == 2) && starts_with(inner, "conv.") && s.sampler)
        return block + "upsamplers.0.conv." + inner.substr(5);
      return sub == 1 ? block + "attentions." + std::to_string(s.layer) + "." + inner : "";
    }
    return "";
  };

  StateDict out;
  for (const auto& [key, tensor] : ldm) {
    const auto mapped = map_key(key);
    out.emplace(mapped.empty() ? prefix + key : mapped, tensor);
  }
  return out;
}

bool is_ldm_controlnet(const StateDict& all) {
  return std::any_of(all.begin(), all.end(), [](const auto& kv) {
    const auto& k = kv.first;
    return k.find("zero_convs.") != std::string::npos || k.find("input_hint_block.") != std::string::npos;
  });
}

StateDict map_ldm_controlnet(const StateDict& all, std::size_t* dropped) {
  const std::string prefix = "control_model.";
  const auto first = all.lower_bound(prefix);
  const bool prefixed = first != all.end() && starts_with(first->first, prefix);
  const StateDict ldm = prefixed ? strip(all, prefix) : all;
  if (dropped) *dropped = all.size() - ldm.size();
  const auto hint = indices(ldm, "input_hint_block.");
  StateDict encoder, out;
  for (const auto& [key, tensor] : ldm) {
    int64_t i = 0;
    std::string rest;
    if (take_index(key, "zero_convs.", i, rest) && starts_with(rest, "0.")) {
      out.emplace("controlnet_down_blocks." + std::to_string(i) + "." + rest.substr(2), tensor);
    } else if (starts_with(key, "middle_block_out.0.")) {
      out.emplace("controlnet_mid_block." + key.substr(19), tensor);
    } else if (take_index(key, "input_hint_block.", i, rest)) {
      const auto pos = std::distance(hint.begin(), hint.find(i));
      const std::string head = "controlnet_cond_embedding.";
      const std::string name = pos == 0 ? "conv_in."
                               : i == *hint.rbegin() ? "conv_out."
                                                     : "blocks." + std::to_string(pos - 1) + ".";
      out.emplace(head + name + rest, tensor);
    } else {
      encoder.emplace(key, tensor);
    }
  }
  if (encoder.empty()) throw Error("no UNet encoder tensors (input_blocks, middle_block, time_embed) in the ControlNet");
  for (auto& kv : map_ldm_unet(encoder, "")) out.insert(std::move(kv));
  return out;
}

StateDict map_ldm_vae(const StateDict& all, const std::string& prefix) {
  const StateDict ldm = strip(all, prefix);
  if (ldm.empty()) throw Error("no VAE tensors under '" + prefix + "'");
  const auto ups = indices(ldm, "decoder.up.");
  const int64_t n_up = ups.empty() ? 0 : *ups.rbegin() + 1;

  const auto resnet = [](const std::string& rest) {
    return starts_with(rest, "nin_shortcut.") ? "conv_shortcut." + rest.substr(13) : rest;
  };
  static const std::pair<const char*, const char*> attention[] = {
      {"norm.", "group_norm."}, {"q.", "to_q."}, {"k.", "to_k."}, {"v.", "to_v."}, {"proj_out.", "to_out.0."}};

  StateDict out;
  for (const auto& [key, tensor] : ldm) {
    if (starts_with(key, "loss.")) continue;  // the training loss (discriminator, logvar)
    std::string mapped;
    at::Tensor value = tensor;
    for (const std::string part : {"encoder.", "decoder."}) {
      if (!starts_with(key, part)) continue;
      const std::string r = key.substr(part.size());
      int64_t i = 0, j = 0;
      std::string rest, inner;
      if (part == "encoder." && take_index(r, "down.", i, rest)) {
        const std::string block = part + "down_blocks." + std::to_string(i) + ".";
        if (take_index(rest, "block.", j, inner)) mapped = block + "resnets." + std::to_string(j) + "." + resnet(inner);
        else if (starts_with(rest, "downsample.conv.")) mapped = block + "downsamplers.0.conv." + rest.substr(16);
      } else if (part == "decoder." && take_index(r, "up.", i, rest) && i < n_up) {
        const std::string block = part + "up_blocks." + std::to_string(n_up - 1 - i) + ".";
        if (take_index(rest, "block.", j, inner)) mapped = block + "resnets." + std::to_string(j) + "." + resnet(inner);
        else if (starts_with(rest, "upsample.conv.")) mapped = block + "upsamplers.0.conv." + rest.substr(14);
      } else if (starts_with(r, "mid.block_1.")) {
        mapped = part + "mid_block.resnets.0." + resnet(r.substr(12));
      } else if (starts_with(r, "mid.block_2.")) {
        mapped = part + "mid_block.resnets.1." + resnet(r.substr(12));
      } else if (starts_with(r, "mid.attn_1.")) {
        const std::string a = r.substr(11);
        for (const auto& [from, to] : attention)
          if (starts_with(a, from)) {
            mapped = part + "mid_block.attentions.0." + to + a.substr(std::string(from).size());
            value = as_linear(tensor);
          }
      } else if (starts_with(r, "norm_out.")) {
        mapped = part + "conv_norm_out." + r.substr(9);
      } else if (starts_with(r, "conv_in.") || starts_with(r, "conv_out.")) {
        mapped = key;
      }
    }
    if (starts_with(key, "quant_conv.") || starts_with(key, "post_quant_conv.")) mapped = key;
    out.emplace(mapped.empty() ? prefix + key : mapped, value);
  }
  return out;
}

StateDict map_sd_clip(const StateDict& all, const std::string& prefix) {
  StateDict out = strip(all, prefix);
  if (out.empty()) throw Error("no CLIP text encoder tensors under '" + prefix + "'");
  out.erase("text_model.embeddings.position_ids");  // a buffer, rebuilt by the model
  out.erase("embeddings.position_ids");
  return map_clip_text_keys(std::move(out));
}

StateDict map_open_clip(const StateDict& all, const std::string& prefix, int64_t num_layers, bool with_projection) {
  const StateDict oc = strip(all, prefix);
  if (oc.empty()) throw Error("no OpenCLIP text encoder tensors under '" + prefix + "'");
  static const std::pair<const char*, const char*> fixed[] = {
      {"token_embedding.weight", "text_model.embeddings.token_embedding.weight"},
      {"positional_embedding", "text_model.embeddings.position_embedding.weight"},
      {"ln_final.weight", "text_model.final_layer_norm.weight"},
      {"ln_final.bias", "text_model.final_layer_norm.bias"}};
  static const std::pair<const char*, const char*> block_names[] = {{"attn.out_proj.", "self_attn.out_proj."},
                                                                    {"ln_1.", "layer_norm1."},
                                                                    {"ln_2.", "layer_norm2."},
                                                                    {"mlp.c_fc.", "mlp.fc1."},
                                                                    {"mlp.c_proj.", "mlp.fc2."}};
  StateDict out;
  for (const auto& [key, tensor] : oc) {
    if (key == "logit_scale" || key == "attn_mask") continue;  // the contrastive head's scale; a rebuilt buffer
    if (key == "text_projection") {
      if (with_projection) out.emplace("text_projection.weight", tensor.t());  // x @ P == Linear with weight P^T
      continue;
    }
    std::string mapped;
    for (const auto& [from, to] : fixed)
      if (key == from) mapped = to;
    int64_t n = 0;
    std::string rest;
    if (mapped.empty() && take_index(key, "transformer.resblocks.", n, rest)) {
      if (num_layers >= 0 && n >= num_layers) continue;  // layers the text model does not use
      const std::string layer = "text_model.encoder.layers." + std::to_string(n) + ".";
      if (rest == "attn.in_proj_weight" || rest == "attn.in_proj_bias") {
        if (tensor.dim() < 1 || tensor.size(0) % 3 != 0)
          throw Error(prefix + key + ": in_proj of " + shape_str(tensor.sizes().vec()) +
                      " cannot be split into query, key and value");
        const auto parts = tensor.chunk(3, 0);
        const std::string kind = rest == "attn.in_proj_weight" ? "weight" : "bias";
        out.emplace(layer + "self_attn.q_proj." + kind, parts[0]);
        out.emplace(layer + "self_attn.k_proj." + kind, parts[1]);
        out.emplace(layer + "self_attn.v_proj." + kind, parts[2]);
        continue;
      }
      for (const auto& [from, to] : block_names)
        if (starts_with(rest, from)) mapped = layer + to + rest.substr(std::string(from).size());
    }
    out.emplace(mapped.empty() ? prefix + key : mapped, tensor);
  }
  return out;
}

// --- SD3 / SD3.5 -------------------------------------------------------------------------------

namespace {

const char* kClipL = "text_encoders.clip_l.transformer.";
const char* kClipG = "text_encoders.clip_g.transformer.";
const char* kT5 = "text_encoders.t5xxl.transformer.";

std::string sd3_transformer_prefix(const ShapeIndex& index) {
  for (const std::string prefix : {"model.diffusion_model.", ""})
    if (index.any_prefix(prefix + "joint_blocks.")) return prefix;
  return "-";
}

}  // namespace

bool is_sd3_single_file(const std::vector<TensorShape>& tensors) {
  for (const auto& t : tensors)
    if (starts_with(t.name, "model.diffusion_model.joint_blocks.") || starts_with(t.name, "joint_blocks.")) return true;
  return false;
}

SD3SingleFileLayout detect_sd3_single_file(const std::vector<TensorShape>& tensors, const std::string& what) {
  const ShapeIndex index(tensors);
  SD3SingleFileLayout l;
  l.transformer_prefix = sd3_transformer_prefix(index);
  if (l.transformer_prefix == "-")
    throw Error(what + ": not an SD3 / SD3.5 checkpoint: no MMDiT (model.diffusion_model.joint_blocks.*)");
  const std::string& tp = l.transformer_prefix;
  const std::string mmdit = "the MMDiT (" + tp + "*)";
  const auto need = [&](const std::string& key, std::size_t rank) -> const std::vector<int64_t>& {
    const auto* shape = index.find(tp + key);
    if (!shape) throw Error(what + ": " + mmdit + " lacks '" + tp + key + "' (a truncated or partial SD3 checkpoint?)");
    if (shape->size() != rank)
      throw Error(what + ": " + mmdit + ": '" + tp + key + "' has shape " + shape_str(*shape) + ", expected " +
                  std::to_string(rank) + " dimensions");
    return *shape;
  };
  const auto bad_shape = [&](const std::string& key, const std::string& expected) {
    throw Error(what + ": " + mmdit + ": '" + tp + key + "' has shape " + shape_str(index.at(tp + key)) +
                ", expected " + expected + " (a damaged file or mixed-up components?)");
  };

  const auto& x_embedder = need("x_embedder.proj.weight", 4);  // [D, Cin, p, p]
  l.hidden_size = x_embedder[0];
  l.in_channels = x_embedder[1];
  l.patch_size = x_embedder[2];
  if (l.patch_size <= 0 || x_embedder[3] != l.patch_size)
    bad_shape("x_embedder.proj.weight", "[D, Cin, p, p] with a patch p of at least 1");
  const auto& pos = need("pos_embed", 3);  // [1, G*G, D]
  const auto grid = square_side(pos[1]);
  l.pos_embed_max_size = grid.value_or(0);
  if (!grid || pos[2] != l.hidden_size)
    bad_shape("pos_embed", "[1, G*G, " + std::to_string(l.hidden_size) + "] (a square position grid)");
  const auto& context = need("context_embedder.weight", 2);  // [D, joint]
  if (context[0] != l.hidden_size) bad_shape("context_embedder.weight", "[" + std::to_string(l.hidden_size) + ", joint]");
  l.joint_attention_dim = context[1];
  l.pooled_projection_dim = need("y_embedder.mlp.0.weight", 2)[1];
  need("y_embedder.mlp.2.weight", 2);
  need("t_embedder.mlp.0.weight", 2);
  need("t_embedder.mlp.2.weight", 2);
  need("final_layer.linear.weight", 2);
  const auto& final_mod = need("final_layer.adaLN_modulation.1.weight", 2);
  if (final_mod[0] != 2 * l.hidden_size)
    bad_shape("final_layer.adaLN_modulation.1.weight", "[" + std::to_string(2 * l.hidden_size) + ", D]");

  const auto blocks = indices(index, tp + "joint_blocks.");
  l.depth = static_cast<int64_t>(blocks.size());
  if (l.depth == 0 || *blocks.rbegin() != l.depth - 1)
    throw Error(what + ": " + mmdit + ": joint_blocks are not numbered 0.." + std::to_string(l.depth - 1) +
                " (a truncated or partial SD3 checkpoint?)");
  l.qk_norm = index.has(tp + "joint_blocks.0.x_block.attn.ln_q.weight");
  const std::string qkv_shape = "[" + std::to_string(3 * l.hidden_size) + ", " + std::to_string(l.hidden_size) + "]";
  for (int64_t b = 0; b < l.depth; ++b) {
    const std::string block = "joint_blocks." + std::to_string(b) + ".";
    for (const std::string part : {"x_block.attn.qkv.weight", "context_block.attn.qkv.weight"}) {
      const auto& qkv = need(block + part, 2);
      if (qkv[0] != 3 * l.hidden_size || qkv[1] != l.hidden_size) bad_shape(block + part, qkv_shape);
    }
    need(block + "x_block.adaLN_modulation.1.weight", 2);
    need(block + "context_block.adaLN_modulation.1.weight", 2);
    need(block + "x_block.mlp.fc1.weight", 2);
    if (l.qk_norm) need(block + "x_block.attn.ln_q.weight", 1);
    if (index.has(tp + block + "x_block.attn2.qkv.weight")) {
      const auto& qkv = need(block + "x_block.attn2.qkv.weight", 2);
      if (qkv[0] != 3 * l.hidden_size || qkv[1] != l.hidden_size) bad_shape(block + "x_block.attn2.qkv.weight", qkv_shape);
      l.dual_attention_layers.push_back(b);
    }
  }
  const bool dual = !l.dual_attention_layers.empty();
  if (l.depth == 24 && l.hidden_size == 1536 && !l.qk_norm && !dual && l.pos_embed_max_size == 192) l.variant = "SD3 medium";
  else if (l.depth == 24 && l.hidden_size == 1536 && l.qk_norm && dual) l.variant = "SD3.5 medium";
  else if (l.depth == 38 && l.hidden_size == 2432 && l.qk_norm && !dual) l.variant = "SD3.5 large";
  else l.variant = "SD3-like";

  // VAE: both halves or none.
  const std::string vae = "first_stage_model.";
  if (index.has(vae + "encoder.conv_in.weight") && index.has(vae + "decoder.conv_in.weight")) {
    l.vae_prefix = vae;
    const auto& dec = index.at(vae + "decoder.conv_in.weight");  // [C, latent, 3, 3]
    if (dec.size() != 4 || dec[1] != l.in_channels)
      throw Error(what + ": the VAE (" + vae + "*) decodes " + (dec.size() == 4 ? std::to_string(dec[1]) : "?") +
                  " latent channels, the MMDiT makes " + std::to_string(l.in_channels) + " (mixed-up components?)");
  } else if (index.any_prefix(vae)) {
    throw Error(what + ": the VAE (" + vae + "*) is incomplete: it lacks " +
                (index.has(vae + "encoder.conv_in.weight") ? vae + "decoder.conv_in.weight" : vae + "encoder.conv_in.weight") +
                " (a truncated file?)");
  }
  // Text encoders: transformers' layouts; a present one must at least have its embeddings.
  int64_t clip_width = 0;
  for (auto [prefix, slot, name] : {std::make_tuple(std::string(kClipL), &l.clip_l_prefix, "CLIP-L"),
                                    std::make_tuple(std::string(kClipG), &l.clip_g_prefix, "CLIP-G")}) {
    const std::string token = prefix + "text_model.embeddings.token_embedding.weight";
    if (index.has(token)) {
      *slot = prefix;
      if (index.at(token).size() == 2) clip_width += index.at(token)[1];
    } else if (index.any_prefix(prefix)) {
      throw Error(what + ": the " + std::string(name) + " text encoder (" + prefix + "*) lacks '" + token +
                  "' (a truncated file?)");
    }
  }
  if (!l.clip_l_prefix.empty() && !l.clip_g_prefix.empty() && clip_width > l.joint_attention_dim)
    throw Error(what + ": CLIP-L and CLIP-G give " + std::to_string(clip_width) +
                " features, more than the MMDiT's context width " + std::to_string(l.joint_attention_dim) +
                " (mixed-up components?)");
  if (index.has(std::string(kT5) + "shared.weight") || index.has(std::string(kT5) + "encoder.embed_tokens.weight")) {
    l.t5_prefix = kT5;
    const auto& emb = index.has(std::string(kT5) + "shared.weight") ? index.at(std::string(kT5) + "shared.weight")
                                                                : index.at(std::string(kT5) + "encoder.embed_tokens.weight");
    if (emb.size() == 2 && emb[1] != l.joint_attention_dim)
      throw Error(what + ": the T5 text encoder (" + std::string(kT5) + "*) gives " + std::to_string(emb[1]) +
                  " features; the MMDiT's context width is " + std::to_string(l.joint_attention_dim) +
                  " (mixed-up components?)");
  } else if (index.any_prefix(kT5)) {
    throw Error(what + ": the T5 text encoder (" + std::string(kT5) + "*) lacks its embedding (" + kT5 +
                "shared.weight; a truncated file?)");
  }
  log::get("io").debug(log::str(what, ": ", l.variant, " single file, ", l.depth, " blocks, width ", l.hidden_size,
                                l.qk_norm ? ", qk norm" : "", dual ? ", dual attention" : ""));
  return l;
}

StateDict map_sd3_transformer(const StateDict& all, const std::string& prefix) {
  const StateDict sai = strip(all, prefix);
  if (sai.empty() || indices(sai, "joint_blocks.").empty())
    throw Error("no SD3 MMDiT tensors (joint_blocks.*) under '" + prefix + "'");
  const int64_t last = *indices(sai, "joint_blocks.").rbegin();
  // (shift, scale) -> (scale, shift) on dim 0.
  const auto swap_halves = [](const at::Tensor& t, const std::string& key) {
    if (t.dim() < 1 || t.size(0) % 2 != 0)
      throw Error(key + ": " + shape_str(t.sizes().vec()) + " cannot be split into shift and scale");
    const auto h = t.chunk(2, 0);
    return at::cat({h[1], h[0]}, 0);
  };
  static const std::pair<const char*, const char*> fixed[] = {
      {"x_embedder.proj.", "pos_embed.proj."},
      {"t_embedder.mlp.0.", "time_text_embed.timestep_embedder.linear_1."},
      {"t_embedder.mlp.2.", "time_text_embed.timestep_embedder.linear_2."},
      {"y_embedder.mlp.0.", "time_text_embed.text_embedder.linear_1."},
      {"y_embedder.mlp.2.", "time_text_embed.text_embedder.linear_2."},
      {"context_embedder.", "context_embedder."},
      {"final_layer.linear.", "proj_out."}};
  // Inside a block, by stream: (original, ours) name prefixes.
  static const std::pair<const char*, const char*> x_names[] = {
      {"attn.ln_q.", "attn.norm_q."},   {"attn.ln_k.", "attn.norm_k."},   {"attn.proj.", "attn.to_out.0."},
      {"attn2.ln_q.", "attn2.norm_q."}, {"attn2.ln_k.", "attn2.norm_k."}, {"attn2.proj.", "attn2.to_out.0."},
      {"adaLN_modulation.1.", "norm1.linear."}, {"mlp.fc1.", "ff.net.0.proj."}, {"mlp.fc2.", "ff.net.2."}};
  static const std::pair<const char*, const char*> context_names[] = {
      {"attn.ln_q.", "attn.norm_added_q."}, {"attn.ln_k.", "attn.norm_added_k."}, {"attn.proj.", "attn.to_add_out."},
      {"adaLN_modulation.1.", "norm1_context.linear."}, {"mlp.fc1.", "ff_context.net.0.proj."},
      {"mlp.fc2.", "ff_context.net.2."}};

  StateDict out;
  const auto put = [&](const std::string& key, const at::Tensor& t) {
    if (!out.emplace(key, t).second) throw Error(prefix + ": two tensors map to '" + key + "'");
  };
  const auto split_qkv = [&](const at::Tensor& t, const std::string& key, const std::string& head,
                             const char* const names[3], const std::string& kind) {
    if (t.dim() < 1 || t.size(0) % 3 != 0)
      throw Error(prefix + key + ": qkv of " + shape_str(t.sizes().vec()) + " cannot be split into query, key and value");
    const auto parts = t.chunk(3, 0);
    for (int i = 0; i < 3; ++i) put(head + names[i] + kind, parts[static_cast<std::size_t>(i)]);
  };
  static const char* const self_qkv[3] = {"to_q.", "to_k.", "to_v."};
  static const char* const added_qkv[3] = {"add_q_proj.", "add_k_proj.", "add_v_proj."};

  for (const auto& [key, tensor] : sai) {
    std::string mapped;
    if (key == "pos_embed") mapped = "pos_embed.pos_embed";
    for (const auto& [from, to] : fixed)
      if (mapped.empty() && starts_with(key, from)) mapped = to + key.substr(std::string(from).size());
    if (starts_with(key, "final_layer.adaLN_modulation.1.")) {
      put("norm_out.linear." + key.substr(31), swap_halves(tensor, prefix + key));
      continue;
    }
    int64_t b = 0;
    std::string rest;
    if (mapped.empty() && take_index(key, "joint_blocks.", b, rest)) {
      const std::string block = "transformer_blocks." + std::to_string(b) + ".";
      const bool x = starts_with(rest, "x_block.");
      const bool ctx = starts_with(rest, "context_block.");
      const std::string inner = x ? rest.substr(8) : ctx ? rest.substr(14) : std::string();
      if (x || ctx) {
        // Fused projections: x_block's attn / attn2 -> to_q/k/v, context_block's attn -> add_*_proj.
        for (const std::string attn : {"attn.", "attn2."}) {
          if (ctx && attn == "attn2.") continue;
          for (const std::string kind : {"weight", "bias"})
            if (inner == attn + "qkv." + kind) {
              split_qkv(tensor, key, block + attn, x ? self_qkv : added_qkv, kind);
              mapped = "-";
            }
        }
        if (mapped == "-") continue;
        if (ctx && b == last && starts_with(inner, "adaLN_modulation.1.")) {
          // The last block's context norm is AdaLayerNormContinuous: (shift, scale) -> (scale, shift).
          put(block + "norm1_context.linear." + inner.substr(19), swap_halves(tensor, prefix + key));
          continue;
        }
        const auto* begin = x ? std::begin(x_names) : std::begin(context_names);
        const auto* end = x ? std::end(x_names) : std::end(context_names);
        for (const auto* it = begin; it != end && mapped.empty(); ++it)
          if (starts_with(inner, it->first)) mapped = block + it->second + inner.substr(std::string(it->first).size());
      }
    }
    put(mapped.empty() ? prefix + key : mapped, tensor);
  }
  return out;
}

StateDict map_sd3_clip(const StateDict& all, const std::string& prefix) {
  StateDict out = map_sd_clip(all, prefix);
  if (!out.count("text_projection.weight")) {
    auto it = out.find("text_model.embeddings.token_embedding.weight");
    if (it == out.end() || it->second.dim() != 2)
      throw Error("no CLIP token embedding under '" + prefix + "' (text_model.embeddings.token_embedding.weight)");
    out.emplace("text_projection.weight", at::eye(it->second.size(1), it->second.options()));
  }
  return out;
}

StateDict map_sd3_t5(const StateDict& all, const std::string& prefix) {
  StateDict out = strip(all, prefix);
  if (out.empty()) throw Error("no T5 text encoder tensors under '" + prefix + "'");
  return map_t5_encoder_keys(std::move(out));
}

// --- FLUX.1 ----------------------------------------------------------------------------------------

namespace {

const char* const kFluxPrefixes[] = {"model.diffusion_model.", ""};

bool flux_scale_key(const std::string& key) {
  return ends_with(key, ".scale_weight") || ends_with(key, ".weight_scale");
}
bool flux_activation_scale_key(const std::string& key) {
  return key == "scaled_fp8" || ends_with(key, ".scaled_fp8") || ends_with(key, ".scale_input") || ends_with(key, ".input_scale");
}

}  // namespace

bool is_flux_single_file(const std::vector<TensorShape>& tensors) {
  std::vector<std::string> heads;
  for (const char* prefix : kFluxPrefixes) heads.push_back(std::string(prefix) + "double_blocks.");
  for (const auto& t : tensors)
    for (const auto& head : heads)
      if (starts_with(t.name, head) && t.name.find(".img_attn.") != std::string::npos) return true;
  return false;
}

FluxSingleFileLayout detect_flux_single_file(const std::vector<TensorShape>& tensors, const std::string& what) {
  const ShapeIndex index(tensors);
  FluxSingleFileLayout l;
  bool found = false;
  for (const char* prefix : kFluxPrefixes) {
    for (const TensorShape* t : index.with_prefix(std::string(prefix) + "double_blocks."))
      if (t->name.find(".img_attn.") != std::string::npos) found = true;
    if (found) {
      l.transformer_prefix = prefix;
      break;
    }
  }
  if (!found) throw Error(what + ": no FLUX transformer tensors (double_blocks.N.img_attn.*)");
  const std::string& p = l.transformer_prefix;
  const std::string where = what + " (transformer at " + (p.empty() ? std::string("the top level") : p + "*") + ")";
  if (index.has(p + "double_stream_modulation_img.lin.weight") || index.has(p + "single_stream_modulation.lin.weight"))
    throw Error(where + ": a FLUX.2 transformer (shared stream modulations), which Diffract does not run; it runs FLUX.1");
  const auto shape = [&](const std::string& key, std::size_t rank) -> const std::vector<int64_t>& {
    const auto* found_shape = index.find(p + key);
    if (!found_shape) throw Error(where + ": incomplete FLUX.1 transformer: no tensor '" + p + key + "'");
    if (found_shape->size() != rank)
      throw Error(where + ": '" + p + key + "' is " + shape_str(*found_shape) + ", expected " + std::to_string(rank) +
                  " dimensions");
    return *found_shape;
  };
  const auto expect = [&](const std::string& key, const std::vector<int64_t>& want) {
    const auto& got = shape(key, want.size());
    if (got != want)
      throw Error(where + ": '" + p + key + "' is " + shape_str(got) + ", expected " + shape_str(want) +
                  " for a width of " + std::to_string(l.hidden_size));
  };
  const auto& img_in = shape("img_in.weight", 2);
  l.hidden_size = img_in[0];
  l.in_channels = img_in[1];
  const int64_t d = l.hidden_size;
  if (d <= 0 || d > (int64_t(1) << 20) || l.in_channels <= 0 || l.in_channels > (int64_t(1) << 20))
    throw Error(where + ": '" + p + "img_in.weight' is " + shape_str(img_in) + ", not a transformer's input projection");
  l.joint_attention_dim = shape("txt_in.weight", 2)[1];
  l.pooled_projection_dim = shape("vector_in.in_layer.weight", 2)[1];
  expect("txt_in.weight", {d, l.joint_attention_dim});
  expect("time_in.out_layer.weight", {d, d});
  expect("vector_in.out_layer.weight", {d, d});
  shape("time_in.in_layer.weight", 2);
  l.guidance = index.has(p + "guidance_in.in_layer.weight");
  if (l.guidance) expect("guidance_in.out_layer.weight", {d, d});
  const auto& final_linear = shape("final_layer.linear.weight", 2);
  expect("final_layer.adaLN_modulation.1.weight", {2 * d, d});
  if (final_linear[1] != d) expect("final_layer.linear.weight", {final_linear[0], d});
  if (final_linear[0] != l.in_channels)
    throw Error(where + ": the transformer takes " + std::to_string(l.in_channels) + " input channels and gives " +
                std::to_string(final_linear[0]) + ": an image-conditioned FLUX.1 (Fill, Depth or Canny), which "
                "Diffract does not run yet; it runs text-to-image FLUX.1 (dev, schnell and their fine-tunes)");

  const auto numbered = [&](const std::string& head) {
    const auto ids = indices(index, p + head);
    if (!ids.empty() && (*ids.begin() != 0 || *ids.rbegin() != static_cast<int64_t>(ids.size()) - 1))
      throw Error(where + ": " + head + "N are not numbered 0.." + std::to_string(ids.size() - 1) + " (found up to " +
                  std::to_string(*ids.rbegin()) + ")");
    return static_cast<int64_t>(ids.size());
  };
  l.double_blocks = numbered("double_blocks.");
  l.single_blocks = numbered("single_blocks.");
  const std::string first_norm = l.double_blocks > 0 ? "double_blocks.0.img_attn.norm.query_norm.scale"
                                                     : "single_blocks.0.norm.query_norm.scale";
  l.head_dim = shape(first_norm, 1)[0];
  if (l.head_dim <= 0 || d % l.head_dim != 0)
    throw Error(where + ": width " + std::to_string(d) + " is not a multiple of the head width " +
                std::to_string(l.head_dim) + " ('" + p + first_norm + "')");
  for (int64_t b = 0; b < l.double_blocks; ++b) {
    const std::string k = "double_blocks." + std::to_string(b) + ".";
    for (const std::string stream : {"img", "txt"}) {
      expect(k + stream + "_mod.lin.weight", {6 * d, d});
      expect(k + stream + "_attn.qkv.weight", {3 * d, d});
      expect(k + stream + "_attn.proj.weight", {d, d});
      expect(k + stream + "_attn.norm.query_norm.scale", {l.head_dim});
      expect(k + stream + "_attn.norm.key_norm.scale", {l.head_dim});
      const auto& mlp0 = shape(k + stream + "_mlp.0.weight", 2);
      expect(k + stream + "_mlp.0.weight", {mlp0[0], d});
      expect(k + stream + "_mlp.2.weight", {d, mlp0[0]});
    }
  }
  for (int64_t b = 0; b < l.single_blocks; ++b) {
    const std::string k = "single_blocks." + std::to_string(b) + ".";
    expect(k + "modulation.lin.weight", {3 * d, d});
    const auto& linear1 = shape(k + "linear1.weight", 2);
    if (linear1[0] <= 3 * d || linear1[1] != d)
      throw Error(where + ": '" + p + k + "linear1.weight' is " + shape_str(linear1) + "; it must hold q, k, v (" +
                  std::to_string(3 * d) + " rows) and the MLP input for a width of " + std::to_string(d));
    expect(k + "linear2.weight", {d, linear1[0] - 2 * d});
    expect(k + "norm.query_norm.scale", {l.head_dim});
    expect(k + "norm.key_norm.scale", {l.head_dim});
  }
  for (const auto& t : tensors) {  // the whole file: an all-in-one's T5 may be scaled float8 too
    if (t.fp8) l.fp8 = true;
    if (flux_scale_key(t.name)) l.fp8_scaled = true;
  }

  for (const std::string vae : {"vae.", "first_stage_model."})
    if (index.has(vae + "decoder.conv_in.weight")) {
      l.vae_prefix = vae;
      const auto& conv_in = index.at(vae + "decoder.conv_in.weight");
      if (conv_in.size() != 4)
        throw Error(what + ": '" + vae + "decoder.conv_in.weight' is " + shape_str(conv_in) + ", not a convolution");
      const int64_t z = conv_in[1];
      if (z * 4 != l.in_channels)
        throw Error(what + ": the VAE (" + vae + "*) has " + std::to_string(z) + " latent channels; the transformer takes " +
                    std::to_string(l.in_channels) + " (4 x the latent channels, packed 2x2)");
      break;
    }
  if (index.has("text_encoders.clip_l.transformer.text_model.embeddings.token_embedding.weight"))
    l.clip_l_prefix = "text_encoders.clip_l.transformer.";
  if (index.has("text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight"))
    l.t5_prefix = "text_encoders.t5xxl.transformer.";
  const bool full = d == 3072 && l.head_dim == 128 && l.double_blocks == 19 && l.single_blocks == 38 &&
                    l.in_channels == 64 && l.joint_attention_dim == 4096 && l.pooled_projection_dim == 768;
  l.variant = !full ? "FLUX-like" : l.guidance ? "FLUX.1-dev" : "FLUX.1-schnell";
  return l;
}

StateDict dequantize_fp8(const StateDict& all, at::ScalarType dtype, const std::string& what, std::size_t* scaled) {
  StateDict out;
  std::size_t n = 0;
  std::set<std::string> folded;
  for (const auto& [key, scale] : all) {
    if (!flux_scale_key(key)) continue;
    const std::string base = key.substr(0, key.size() - std::string(".scale_weight").size());
    const auto it = all.find(base + ".weight");
    if (it == all.end()) throw Error(what + ": weight scale '" + key + "' has no '" + base + ".weight' beside it");
    const auto& w = it->second;
    at::Tensor s = scale.to(at::kFloat);
    if (s.numel() == 1) {
      s = s.reshape({});
    } else if (w.dim() >= 1 && s.numel() == w.size(0) && (s.dim() == 1 || (s.dim() == 2 && s.size(1) == 1))) {
      std::vector<int64_t> shape(static_cast<std::size_t>(w.dim()), 1);
      shape[0] = w.size(0);
      s = s.reshape(shape);
    } else {
      throw Error(what + ": weight scale '" + key + "' is " + shape_str(scale.sizes().vec()) + "; for '" + base +
                  ".weight' " + shape_str(w.sizes().vec()) + " it must be one value or one per output channel");
    }
    if (!at::isFloatingType(w.scalar_type()))
      throw Error(what + ": '" + base + ".weight' is " + std::string(c10::toString(w.scalar_type())) +
                  ", which a weight scale cannot apply to");
    out.emplace(base + ".weight", (w.to(at::kFloat) * s).to(dtype));
    folded.insert(base + ".weight");
    ++n;
  }
  for (const auto& [key, t] : all)
    if (!flux_scale_key(key) && !flux_activation_scale_key(key) && !folded.count(key)) out.emplace(key, t);
  if (scaled) *scaled = n;
  return out;
}

StateDict map_flux_transformer(const StateDict& all, const std::string& prefix) {
  const StateDict bfl = strip(all, prefix);
  if (bfl.empty() || indices(bfl, "double_blocks.").empty())
    throw Error("no FLUX transformer tensors (double_blocks.*) under '" + prefix + "'");
  const auto img_in = bfl.find("img_in.weight");
  if (img_in == bfl.end()) throw Error("no FLUX transformer input projection ('" + prefix + "img_in.weight')");
  const int64_t d = img_in->second.size(0);
  static const std::pair<const char*, const char*> fixed[] = {
      {"img_in.", "x_embedder."},
      {"txt_in.", "context_embedder."},
      {"time_in.in_layer.", "time_text_embed.timestep_embedder.linear_1."},
      {"time_in.out_layer.", "time_text_embed.timestep_embedder.linear_2."},
      {"vector_in.in_layer.", "time_text_embed.text_embedder.linear_1."},
      {"vector_in.out_layer.", "time_text_embed.text_embedder.linear_2."},
      {"guidance_in.in_layer.", "time_text_embed.guidance_embedder.linear_1."},
      {"guidance_in.out_layer.", "time_text_embed.guidance_embedder.linear_2."},
      {"final_layer.linear.", "proj_out."}};
  static const std::pair<const char*, const char*> double_names[] = {
      {"img_mod.lin.", "norm1.linear."},
      {"txt_mod.lin.", "norm1_context.linear."},
      {"img_attn.norm.query_norm.scale", "attn.norm_q.weight"},
      {"img_attn.norm.key_norm.scale", "attn.norm_k.weight"},
      {"txt_attn.norm.query_norm.scale", "attn.norm_added_q.weight"},
      {"txt_attn.norm.key_norm.scale", "attn.norm_added_k.weight"},
      {"img_attn.proj.", "attn.to_out.0."},
      {"txt_attn.proj.", "attn.to_add_out."},
      {"img_mlp.0.", "ff.net.0.proj."},
      {"img_mlp.2.", "ff.net.2."},
      {"txt_mlp.0.", "ff_context.net.0.proj."},
      {"txt_mlp.2.", "ff_context.net.2."}};
  static const std::pair<const char*, const char*> single_names[] = {
      {"modulation.lin.", "norm.linear."},
      {"norm.query_norm.scale", "attn.norm_q.weight"},
      {"norm.key_norm.scale", "attn.norm_k.weight"},
      {"linear2.", "proj_out."}};

  StateDict out;
  const auto put = [&](const std::string& key, const at::Tensor& t) {
    if (!out.emplace(key, t).second) throw Error(prefix + ": two tensors map to '" + key + "'");
  };
  const auto rename = [](const std::string& rest, const auto& names, const std::string& head) -> std::string {
    for (const auto& [from, to] : names)
      if (starts_with(rest, from)) return head + to + rest.substr(std::string(from).size());
    return {};
  };
  for (const auto& [key, tensor] : bfl) {
    if (prefix.empty() && (starts_with(key, "vae.") || starts_with(key, "first_stage_model.") ||
                           starts_with(key, "text_encoders.")))
      continue;  // the other components of a file whose transformer has no prefix
    if (starts_with(key, "final_layer.adaLN_modulation.1.")) {
      if (tensor.dim() < 1 || tensor.size(0) % 2 != 0)
        throw Error(prefix + key + ": " + shape_str(tensor.sizes().vec()) + " cannot be split into shift and scale");
      const auto h = tensor.chunk(2, 0);  // (shift, scale) -> diffusers' (scale, shift)
      put("norm_out.linear." + key.substr(31), at::cat({h[1], h[0]}, 0));
      continue;
    }
    std::string mapped;
    for (const auto& [from, to] : fixed)
      if (mapped.empty() && starts_with(key, from)) mapped = to + key.substr(std::string(from).size());
    int64_t b = 0;
    std::string rest;
    if (mapped.empty() && take_index(key, "double_blocks.", b, rest)) {
      const std::string block = "transformer_blocks." + std::to_string(b) + ".";
      const bool img = starts_with(rest, "img_attn.qkv."), txt = starts_with(rest, "txt_attn.qkv.");
      if (img || txt) {
        const std::string kind = rest.substr(13);
        if (tensor.dim() < 1 || tensor.size(0) != 3 * d)
          throw Error(prefix + key + ": qkv of " + shape_str(tensor.sizes().vec()) + " is not 3 x the width " +
                      std::to_string(d));
        const auto parts = tensor.chunk(3, 0);
        static const char* const self[3] = {"attn.to_q.", "attn.to_k.", "attn.to_v."};
        static const char* const added[3] = {"attn.add_q_proj.", "attn.add_k_proj.", "attn.add_v_proj."};
        for (int i = 0; i < 3; ++i) put(block + (img ? self : added)[i] + kind, parts[static_cast<std::size_t>(i)]);
        continue;
      }
      mapped = rename(rest, double_names, block);
    } else if (mapped.empty() && take_index(key, "single_blocks.", b, rest)) {
      const std::string block = "single_transformer_blocks." + std::to_string(b) + ".";
      if (starts_with(rest, "linear1.")) {
        const std::string kind = rest.substr(8);
        if (tensor.dim() < 1 || tensor.size(0) <= 3 * d)
          throw Error(prefix + key + ": " + shape_str(tensor.sizes().vec()) + " does not hold q, k, v (" +
                      std::to_string(d) + " rows each) and the MLP input");
        const auto parts = tensor.split_with_sizes({d, d, d, tensor.size(0) - 3 * d}, 0);
        static const char* const names[4] = {"attn.to_q.", "attn.to_k.", "attn.to_v.", "proj_mlp."};
        for (int i = 0; i < 4; ++i) put(block + names[i] + kind, parts[static_cast<std::size_t>(i)]);
        continue;
      }
      mapped = rename(rest, single_names, block);
    }
    put(mapped.empty() ? prefix + key : mapped, tensor);  // unknown: kept, so a strict bind names it
  }
  return out;
}

}  // namespace diffract::io
