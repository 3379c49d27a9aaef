#include "core/engine/png_parameters.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <regex>

#include <nlohmann/json.hpp>

#include "core/io/json_file.h"
#include "core/util/error.h"

namespace diffract::engine {

using nlohmann::json;

namespace {

const std::string* find_chunk(const io::PngText& text, const std::string& key) {
  for (const auto& [k, v] : text)
    if (k == key) return &v;
  return nullptr;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

std::optional<long long> whole_number(const std::string& s) {
  const std::string t = trim(s);
  if (t.empty() || t.size() > 18 || !std::all_of(t.begin() + (t[0] == '-' ? 1 : 0), t.end(), ::isdigit) || t == "-")
    return std::nullopt;
  return std::stoll(t);
}

std::optional<double> real_number(const std::string& s) {
  const std::string t = trim(s);
  try {
    std::size_t used = 0;
    const double v = std::stod(t, &used);
    if (used == t.size() && std::isfinite(v)) return v;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// ---- Diffract's own JSON ----

PngParameters from_diffract(const std::string& text, const std::string& where) {
  const json j = io::parse_json(text, where + ": the 'diffract' text chunk");
  if (!j.is_object()) throw Error(where + ": the 'diffract' text chunk is not a JSON object");
  PngParameters p;
  p.source = "diffract";
  for (const auto& item : j.items()) {
    const std::string& key = item.key();
    const json& v = item.value();
    auto bad = [&] { p.unmapped.push_back(key + ": " + io::json_brief(v) + " (unexpected type)"); };
    auto text_to = [&](std::optional<std::string>& out) { v.is_string() ? void(out = v.get<std::string>()) : bad(); };
    auto int_to = [&](std::optional<int>& out) {
      v.is_number_integer() && v.get<long long>() >= 0 && v.get<long long>() < (1LL << 31) ? void(out = v.get<int>())
                                                                                            : bad();
    };
    if (key == "prompt") text_to(p.prompt);
    else if (key == "negative_prompt") text_to(p.negative_prompt);
    else if (key == "model") text_to(p.model);
    else if (key == "sampler") text_to(p.sampler);
    else if (key == "taesd") text_to(p.taesd);
    else if (key == "device") text_to(p.device);
    else if (key == "strategy_name") text_to(p.strategy);
    else if (key == "width") int_to(p.width);
    else if (key == "height") int_to(p.height);
    else if (key == "steps") int_to(p.steps);
    else if (key == "batch") int_to(p.batch);
    else if (key == "batch_index") int_to(p.batch_index);
    else if (key == "devices") int_to(p.devices);
    else if (key == "skip") int_to(p.skip);
    else if (key == "cfg") v.is_number() ? void(p.cfg = v.get<double>()) : bad();
    else if (key == "guidance") v.is_number() ? void(p.guidance = v.get<double>()) : bad();
    else if (key == "cache_threshold") v.is_number() ? void(p.cache_threshold = v.get<double>()) : bad();
    else if (key == "input" && v.is_object()) {
      // The image inputs: their files (written beside the PNG by the GUI) and strength.
      if (v.contains("strength") && v["strength"].is_number()) p.strength = v["strength"].get<double>();
      if (v.contains("input_file") && v["input_file"].is_string()) p.input_file = v["input_file"].get<std::string>();
      if (v.contains("mask_file") && v["mask_file"].is_string()) p.mask_file = v["mask_file"].get<std::string>();
      if (!p.input_file) p.unmapped.push_back("input image: " + v.value("image", std::string("?")) + " (not saved with the PNG)");
      if (v.contains("outpaint") && v["outpaint"].is_object())
        p.unmapped.push_back("outpaint margins: " + io::json_brief(v["outpaint"].value("margins", nlohmann::json::array())));
    }
    else if (key == "prompt_syntax") text_to(p.prompt_syntax);
    else if (key == "precision") text_to(p.precision);
    else if (key == "loras" && v.is_array()) {
      for (const auto& l : v) {
        if (!l.is_object() || !l.contains("path") || !l["path"].is_string()) {
          p.unmapped.push_back("LoRA: " + io::json_brief(l) + " (no path)");
          continue;
        }
        PngParameters::Lora x;
        x.path = l["path"].get<std::string>();
        x.name = l.value("name", std::string());
        x.weight = l.contains("weight") && l["weight"].is_number() ? l["weight"].get<double>() : 1.0;
        x.text_encoder_weight = l.contains("text_encoder_weight") && l["text_encoder_weight"].is_number()
                                    ? l["text_encoder_weight"].get<double>() : x.weight;
        p.loras.push_back(x);
      }
    }
    else if (key == "controlnets" && v.is_array()) {
      for (const auto& c : v) {
        if (!c.is_object() || !c.contains("path") || !c["path"].is_string()) {
          p.unmapped.push_back("ControlNet: " + io::json_brief(c) + " (no path)");
          continue;
        }
        const auto number = [&](const char* k, double fallback) {
          return c.contains(k) && c[k].is_number() ? c[k].get<double>() : fallback;
        };
        PngParameters::ControlNet x;
        x.path = c["path"].get<std::string>();
        x.scale = number("scale", 1.0);
        x.start = number("start", 0.0);
        x.end = number("end", 1.0);
        if (c.contains("image_file") && c["image_file"].is_string()) x.image_file = c["image_file"].get<std::string>();
        if (c.contains("preprocessor") && c["preprocessor"].is_string()) x.preprocessor = c["preprocessor"].get<std::string>();
        x.low = static_cast<int>(number("low", 100));
        x.high = static_cast<int>(number("high", 200));
        p.controlnets.push_back(x);
      }
    }
    else if (key == "seed") v.is_number_unsigned() ? void(p.seed = v.get<std::uint64_t>()) : bad();
    else if (key == "diffract_version" || key == "family" || key == "timings_ms" || key == "strategy" ||
             key == "negative_conditioning" || key == "initial_latents" || key == "options" ||
             key == "loras_apply_ms")
      continue;  // about the run, not settings for the next one
    else p.unmapped.push_back(key + ": " + io::json_brief(v));
  }
  return p;
}

// ---- AUTOMATIC1111 "parameters" ----

bool word_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }
bool space_char(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }

// The "Key: value" pairs of a settings line, as A1111's re_param finds them,
// \s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$) searched over the line, written out as a
// loop: libstdc++'s regex recurses once per character of a match, so a long quoted value from
// someone's PNG overflowed the stack.
std::vector<std::pair<std::string, std::string>> settings_pairs(const std::string& line) {
  std::vector<std::pair<std::string, std::string>> out;
  const std::size_t n = line.size();
  // The match starting at `at`, if any, and its end; else npos, with `resume` where the next
  // match can start: no start inside a key-like run that is not followed by ':' can match
  // (searching one position further each time was quadratic on a long line without colons).
  std::size_t resume = 0;
  const auto match_at = [&](std::size_t at, std::pair<std::string, std::string>& kv) -> std::size_t {
    std::size_t i = at;
    resume = at + 1;
    while (i < n && space_char(line[i])) ++i;
    const std::size_t key = i;
    if (i >= n || !word_char(line[i])) return std::string::npos;
    ++i;
    while (i < n && (word_char(line[i]) || line[i] == ' ' || line[i] == '-' || line[i] == '/')) ++i;
    resume = std::max(resume, i);
    if (i - key < 2 || i >= n || line[i] != ':') return std::string::npos;
    kv.first = trim(line.substr(key, i - key));
    ++i;
    while (i < n && space_char(line[i])) ++i;
    if (i < n && line[i] == '"') {  // a quoted value, escapes kept, then a comma or the end
      std::size_t j = i + 1, chars = 0;
      while (j < n && line[j] != '"') {
        if (line[j] == '\\') {
          if (j + 1 >= n || line[j + 1] == '\n' || line[j + 1] == '\r') break;
          j += 2;
        } else {
          ++j;
        }
        ++chars;
      }
      if (chars > 0 && j < n && line[j] == '"' && (j + 1 == n || line[j + 1] == ',')) {
        kv.second = trim(line.substr(i, j + 1 - i));
        return j + 1 == n ? n : j + 2;
      }
    }
    const std::size_t comma = line.find(',', i);
    kv.second = trim(line.substr(i, comma == std::string::npos ? std::string::npos : comma - i));
    return comma == std::string::npos ? n : comma + 1;
  };
  for (std::size_t at = 0; at < n;) {
    std::pair<std::string, std::string> kv;
    const std::size_t end = match_at(at, kv);
    if (end == std::string::npos) {
      at = resume;
      continue;
    }
    out.push_back(std::move(kv));
    at = end;
  }
  return out;
}

PngParameters from_a1111(const std::string& text, const std::string& where) {
  // As A1111's parse_generation_parameters: prompt lines, "Negative prompt:" lines, and a last
  // line of "Key: value" pairs (values may be JSON-quoted) when it has at least three.
  std::vector<std::string> lines;
  {
    const std::string t = trim(text);
    for (std::size_t from = 0;;) {
      const auto nl = t.find('\n', from);
      lines.push_back(t.substr(from, nl == std::string::npos ? std::string::npos : nl - from));
      if (nl == std::string::npos) break;
      from = nl + 1;
    }
  }
  std::vector<std::pair<std::string, std::string>> pairs;
  {
    const std::string& last = lines.back();
    auto found = settings_pairs(last);
    if (found.size() >= 3) {
      pairs = std::move(found);
      lines.pop_back();
    }
  }
  if (pairs.empty()) throw Error(where + ": the 'parameters' text chunk has no settings line (\"Steps: ..., Sampler: ...\")");

  PngParameters p;
  p.source = "a1111";
  std::string prompt, negative;
  bool in_negative = false;
  for (std::string line : lines) {
    line = trim(line);
    if (line.rfind("Negative prompt:", 0) == 0) {
      in_negative = true;
      line = trim(line.substr(16));
    }
    std::string& to = in_negative ? negative : prompt;
    to += (to.empty() ? "" : "\n") + line;
  }
  p.prompt = prompt;
  p.negative_prompt = negative;

  std::string sampler, schedule;
  for (auto [key, value] : pairs) {
    if (value.size() >= 2 && value.front() == '"') {
      try {
        value = io::parse_json(value, "").get<std::string>();
      } catch (const std::exception&) {  // not a JSON string: kept as written
      }
    }
    const std::string shown = key + ": " + value;
    if (key == "Steps") {
      const auto n = whole_number(value);
      n && *n >= 1 && *n <= 10000 ? void(p.steps = static_cast<int>(*n)) : p.unmapped.push_back(shown + " (not a step count)");
    } else if (key == "CFG scale") {
      const auto v = real_number(value);
      v ? void(p.cfg = *v) : p.unmapped.push_back(shown + " (not a number)");
    } else if (key == "Distilled CFG Scale") {
      const auto v = real_number(value);
      v ? void(p.guidance = *v) : p.unmapped.push_back(shown + " (not a number)");
    } else if (key == "Seed") {
      const auto n = whole_number(value);
      n && *n >= 0 ? void(p.seed = static_cast<std::uint64_t>(*n)) : p.unmapped.push_back(shown + " (not a seed)");
    } else if (key == "Size") {
      static const std::regex kSize(R"((\d{1,5})x(\d{1,5}))");
      std::smatch m;
      if (std::regex_match(value, m, kSize) && std::stoi(m[1]) > 0 && std::stoi(m[2]) > 0) {
        p.width = std::stoi(m[1]);
        p.height = std::stoi(m[2]);
      } else {
        p.unmapped.push_back(shown + " (not WIDTHxHEIGHT)");
      }
    } else if (key == "Batch size") {
      const auto n = whole_number(value);
      n && *n >= 1 && *n <= 1000 ? void(p.batch = static_cast<int>(*n)) : p.unmapped.push_back(shown);
    } else if (key == "Batch pos") {
      const auto n = whole_number(value);
      n && *n >= 0 && *n < 1000 ? void(p.batch_index = static_cast<int>(*n)) : p.unmapped.push_back(shown);
    } else if (key == "Sampler") {
      sampler = value;
    } else if (key == "Schedule type") {
      schedule = value;
    } else if (key == "Model") {
      p.model_name = value;
    } else if (key == "Lora hashes") {
      // "name: hash, name: hash"
      std::size_t from = 0;
      while (from < value.size()) {
        auto comma = value.find(',', from);
        if (comma == std::string::npos) comma = value.size();
        const auto item = trim(value.substr(from, comma - from));
        const auto colon = item.rfind(':');
        if (colon != std::string::npos && colon > 0)
          p.lora_hashes.emplace_back(trim(item.substr(0, colon)), trim(item.substr(colon + 1)));
        else if (!item.empty())
          p.unmapped.push_back("Lora hashes: " + item + " (not NAME: HASH)");
        from = comma + 1;
      }
    } else if (key == "Version") {
      continue;  // the program that wrote it, not a setting
    } else {
      p.unmapped.push_back(shown);
    }
  }
  if (!sampler.empty()) {
    if (auto ours = sampler_from_a1111(sampler, schedule)) p.sampler = *ours;
    else p.unmapped.push_back("Sampler: " + sampler + (schedule.empty() ? "" : ", Schedule type: " + schedule) +
                              " (no Diffract sampler matches)");
  }
  return p;
}

// ---- ComfyUI "prompt" (the API-format graph) ----

struct ComfyGraph {
  const json& nodes;

  // The node a link ([id, slot]) points at, or nullptr.
  const json* linked(const json& input) const {
    if (!input.is_array() || input.size() != 2) return nullptr;
    const std::string id = input[0].is_string() ? input[0].get<std::string>() : io::json_brief(input[0]);
    const auto it = nodes.find(id);
    return it != nodes.end() && it->is_object() ? &*it : nullptr;
  }
  static std::string class_of(const json& node) {
    return node.contains("class_type") && node["class_type"].is_string() ? node["class_type"].get<std::string>() : "?";
  }
  static const json* input(const json& node, const char* name) {
    if (!node.contains("inputs") || !node["inputs"].is_object() || !node["inputs"].contains(name)) return nullptr;
    return &node["inputs"][name];
  }
};

void comfy_text(const ComfyGraph& g, const json& sampler, const char* which, std::optional<std::string>& out,
                std::vector<std::string>& unmapped) {
  const json* link = ComfyGraph::input(sampler, which);
  const json* node = link ? g.linked(*link) : nullptr;
  if (!node) {
    unmapped.push_back(std::string(which) + " prompt: no linked node");
    return;
  }
  const std::string cls = ComfyGraph::class_of(*node);
  const json* text = nullptr;
  if (cls == "CLIPTextEncode") text = ComfyGraph::input(*node, "text");
  else if (cls == "CLIPTextEncodeSDXL") {
    text = ComfyGraph::input(*node, "text_g");
    const json* l = ComfyGraph::input(*node, "text_l");
    if (text && l && *l != *text) unmapped.push_back(std::string(which) + " text_l: " + io::json_brief(*l) + " (differs from text_g)");
  }
  if (text && text->is_string()) out = text->get<std::string>();
  else unmapped.push_back(std::string(which) + " prompt: from a " + cls + " node" + (text ? " input" : "") +
                          " (only CLIPTextEncode text is read)");
}

PngParameters from_comfyui(const std::string& text, const std::string& where) {
  const json nodes = io::parse_json(text, where + ": the ComfyUI 'prompt' text chunk");
  if (!nodes.is_object()) throw Error(where + ": the ComfyUI 'prompt' text chunk is not a JSON object of nodes");
  const ComfyGraph g{nodes};
  std::vector<std::string> samplers;
  for (const auto& [id, node] : nodes.items()) {
    const std::string cls = node.is_object() ? ComfyGraph::class_of(node) : "";
    if (cls == "KSampler" || cls == "KSamplerAdvanced") samplers.push_back(id);
  }
  if (samplers.empty()) throw Error(where + ": the ComfyUI graph has no KSampler or KSamplerAdvanced node");
  std::sort(samplers.begin(), samplers.end(), [](const std::string& a, const std::string& b) {
    return a.size() != b.size() ? a.size() < b.size() : a < b;  // numeric ids in numeric order
  });
  const json& ks = nodes[samplers.front()];
  const bool advanced = ComfyGraph::class_of(ks) == "KSamplerAdvanced";

  PngParameters p;
  p.source = "comfyui";
  if (samplers.size() > 1)
    p.unmapped.push_back(std::to_string(samplers.size()) + " sampler nodes: read node " + samplers.front() +
                         " only");
  auto number = [&](const char* name) -> const json* {
    const json* v = ComfyGraph::input(ks, name);
    if (v && v->is_number()) return v;
    if (v) p.unmapped.push_back(std::string(name) + ": " + io::json_brief(*v) + " (not a number: a linked node?)");
    return nullptr;
  };
  if (const json* v = number(advanced ? "noise_seed" : "seed"); v && v->is_number_unsigned()) p.seed = v->get<std::uint64_t>();
  if (const json* v = number("steps"); v && v->is_number_integer() && v->get<long long>() >= 1 &&
                                       v->get<long long>() <= 10000)
    p.steps = v->get<int>();
  if (const json* v = number("cfg")) p.cfg = v->get<double>();
  const json* sampler_name = ComfyGraph::input(ks, "sampler_name");
  const json* scheduler = ComfyGraph::input(ks, "scheduler");
  if (sampler_name && scheduler && sampler_name->is_string() && scheduler->is_string()) {
    if (auto ours = sampler_from_comfyui(*sampler_name, *scheduler)) p.sampler = *ours;
    else p.unmapped.push_back("sampler_name: " + sampler_name->get<std::string>() + ", scheduler: " +
                              scheduler->get<std::string>() + " (no Diffract sampler matches)");
  }
  if (!advanced) {
    if (const json* d = ComfyGraph::input(ks, "denoise"); d && !(d->is_number() && d->get<double>() == 1.0))
      p.unmapped.push_back("denoise: " + io::json_brief(*d) + " (image to image)");
  } else {
    if (const json* s = ComfyGraph::input(ks, "start_at_step"); s && !(s->is_number() && s->get<double>() == 0))
      p.unmapped.push_back("start_at_step: " + io::json_brief(*s));
    if (const json* e = ComfyGraph::input(ks, "end_at_step");
        e && !(e->is_number() && p.steps && e->get<double>() >= *p.steps))
      p.unmapped.push_back("end_at_step: " + io::json_brief(*e));
  }
  comfy_text(g, ks, "positive", p.prompt, p.unmapped);
  comfy_text(g, ks, "negative", p.negative_prompt, p.unmapped);

  const json* latent_link = ComfyGraph::input(ks, "latent_image");
  const json* latent = latent_link ? g.linked(*latent_link) : nullptr;
  const std::string latent_cls = latent ? ComfyGraph::class_of(*latent) : "?";
  if (latent && (latent_cls == "EmptyLatentImage" || latent_cls == "EmptySD3LatentImage")) {
    auto dim = [&](const char* name, std::optional<int>& out) {
      const json* v = ComfyGraph::input(*latent, name);
      if (v && v->is_number_integer() && v->get<long long>() > 0 && v->get<long long>() < 100000) out = v->get<int>();
      else p.unmapped.push_back(std::string(name) + ": " + (v ? io::json_brief(*v) : "missing"));
    };
    dim("width", p.width);
    dim("height", p.height);
    dim("batch_size", p.batch);
  } else {
    p.unmapped.push_back("latent_image: from a " + latent_cls + " node (not an empty latent: image to image?)");
  }

  // The checkpoint behind the sampler's model input, through LoRA and other model patches.
  const json* model_link = ComfyGraph::input(ks, "model");
  for (int hops = 0; model_link && hops < 16; ++hops) {
    const json* node = g.linked(*model_link);
    if (!node) break;
    if (const json* ckpt = ComfyGraph::input(*node, "ckpt_name"); ckpt && ckpt->is_string()) {
      p.model_name = ckpt->get<std::string>();
      break;
    }
    if (const json* unet = ComfyGraph::input(*node, "unet_name"); unet && unet->is_string()) {
      p.model_name = unet->get<std::string>();
      break;
    }
    if (const json* lora = ComfyGraph::input(*node, "lora_name"))
      p.unmapped.push_back("LoRA: " + (lora->is_string() ? lora->get<std::string>() : io::json_brief(*lora)));
    else
      p.unmapped.push_back("model patched by a " + ComfyGraph::class_of(*node) + " node");
    model_link = ComfyGraph::input(*node, "model");
  }
  return p;
}

}  // namespace

std::optional<std::string> sampler_from_a1111(const std::string& sampler, const std::string& schedule_type) {
  const bool plain = schedule_type.empty() || schedule_type == "Automatic";
  const bool karras = schedule_type == "Karras";
  if (sampler == "Euler" && (plain || schedule_type == "Normal")) return "euler";
  if (sampler == "Euler a" && (plain || schedule_type == "Normal")) return "euler-ancestral";
  if (sampler == "DDIM" && (plain || schedule_type == "DDIM")) return "ddim";
  if (sampler == "DDPM" && plain) return "ddpm";
  if (sampler == "DPM++ 2M Karras" && (plain || karras)) return "dpmpp-2m-karras";
  if (sampler == "DPM++ 2M") {
    // Since A1111 1.9 "Automatic" means DPM++ 2M's default schedule, Karras; before, no
    // schedule type was written and "DPM++ 2M" meant the plain one.
    if (schedule_type.empty() || schedule_type == "Normal") return "dpmpp-2m";
    if (karras || schedule_type == "Automatic") return "dpmpp-2m-karras";
  }
  return std::nullopt;
}

std::optional<std::string> sampler_from_comfyui(const std::string& sampler_name, const std::string& scheduler) {
  const bool normal = scheduler == "normal" || scheduler == "simple";
  if (sampler_name == "euler" && normal) return "euler";
  if (sampler_name == "euler_ancestral" && normal) return "euler-ancestral";
  if (sampler_name == "ddim" && (normal || scheduler == "ddim_uniform")) return "ddim";
  if (sampler_name == "ddpm" && normal) return "ddpm";
  if (sampler_name == "dpmpp_2m" && normal) return "dpmpp-2m";
  if (sampler_name == "dpmpp_2m" && scheduler == "karras") return "dpmpp-2m-karras";
  return std::nullopt;
}

PngParameters parse_png_parameters(const io::PngText& text, const std::string& where) {
  if (const auto* d = find_chunk(text, "diffract")) return from_diffract(*d, where);
  if (const auto* a = find_chunk(text, "parameters")) return from_a1111(*a, where);
  if (const auto* c = find_chunk(text, "prompt")) return from_comfyui(*c, where);
  std::string keys;
  for (const auto& [k, v] : text) keys += (keys.empty() ? "" : ", ") + k;
  throw Error(where + ": no generation parameters (no 'diffract', 'parameters' or ComfyUI 'prompt' text chunk" +
              (keys.empty() ? std::string("; the PNG has no text chunks)") : "; its text chunks: " + keys + ")"));
}

PngParameters read_png_parameters(const std::filesystem::path& png) {
  io::PngText text;
  io::read_png(png, &text);
  return parse_png_parameters(text, png.string());
}

}  // namespace diffract::engine
