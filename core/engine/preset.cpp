#include "core/engine/preset.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/io/json_fields.h"
#include "core/io/json_file.h"
#include "core/io/read_file.h"
#include "core/parallel/registry.h"
#include "core/parallel/strategy.h"
#include "core/schedulers/sampler.h"
#include "core/util/error.h"

namespace diffract::engine {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::set<std::string> kKeys = {"name",    "description", "prompt_template", "negative_prompt", "width",
                                     "height",  "steps",       "sampler",         "cfg",             "strategy",
                                     "guidance", "devices", "skip",        "cache_threshold", "loras",
                                     "controlnets", "precision"};

std::string field(const std::string& where, const std::string& key) { return where + ": field '" + key + "'"; }

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

}  // namespace

void validate_preset(const Preset& p, const std::string& where) {
  if (p.name.find_first_not_of(" \t\r\n") == std::string::npos) throw Error(field(where, "name") + " is empty");
  if (p.prompt_template.find(kSubjectPlaceholder) == std::string::npos)
    throw Error(field(where, "prompt_template") + " has no " + kSubjectPlaceholder +
                " placeholder for the user's prompt");
  for (const auto& [key, v] : {std::pair<const char*, int>{"width", p.width}, {"height", p.height}})
    if (v < 0 || v > 8192 || v % 8 != 0)
      throw Error(field(where, key) + " is " + std::to_string(v) +
                  ": must be 0 (the model's size) or a multiple of 8 up to 8192");
  if ((p.width == 0) != (p.height == 0))
    throw Error(field(where, p.width == 0 ? "width" : "height") + " is 0 but the other side is not: give both or neither");
  if (p.steps < 1 || p.steps > 1000)
    throw Error(field(where, "steps") + " is " + std::to_string(p.steps) + ": must be between 1 and 1000");
  if (!(p.cfg >= 0 && p.cfg <= 30))
    throw Error(field(where, "cfg") + " is " + std::to_string(p.cfg) + ": must be between 0 and 30");
  if (!(p.guidance >= 0 && p.guidance <= 100))
    throw Error(field(where, "guidance") + " is " + std::to_string(p.guidance) + ": must be between 0 and 100");
  if (!p.sampler.empty() && !schedulers::parse_sampler(p.sampler)) {
    std::string valid;
    for (const auto& n : schedulers::sampler_names()) valid += (valid.empty() ? "" : ", ") + n;
    throw Error(field(where, "sampler") + ": unknown sampler '" + p.sampler + "' (valid: " + valid +
                ", or empty for the model's own)");
  }
  if (p.devices < 1 || p.devices > 64)
    throw Error(field(where, "devices") + " is " + std::to_string(p.devices) + ": must be between 1 and 64");
  for (std::size_t i = 0; i < p.loras.size(); ++i) {
    const auto& l = p.loras[i];
    const auto at = field(where, "loras") + " entry " + std::to_string(i + 1);
    if (l.name.find_first_not_of(" \t") == std::string::npos) throw Error(at + ": the name is empty");
    if (l.name.find_first_of("<>:") != std::string::npos)
      throw Error(at + ": the name '" + l.name + "' holds one of < > : (a LoRA file's stem has none)");
    for (const double w : {l.weight, l.text_encoder_weight})
      if (!(w >= -10 && w <= 10)) throw Error(at + ": weight " + std::to_string(w) + " is outside -10..10");
  }
  for (std::size_t i = 0; i < p.controlnets.size(); ++i) {
    const auto& c = p.controlnets[i];
    const auto at = field(where, "controlnets") + " entry " + std::to_string(i + 1);
    if (c.model.empty()) throw Error(at + ": the model is empty");
    const auto& names = control_preprocessors();
    if (std::find(names.begin(), names.end(), c.preprocessor) == names.end())
      throw Error(at + ": unknown preprocessor '" + c.preprocessor + "' (valid: none, canny)");
    if (c.low < 0 || c.high > 1000 || c.low > c.high)
      throw Error(at + ": canny thresholds " + std::to_string(c.low) + " / " + std::to_string(c.high) +
                  " must satisfy 0 <= low <= high <= 1000");
    if (!(c.scale >= 0 && c.scale <= 5)) throw Error(at + ": scale " + std::to_string(c.scale) + " is outside 0..5");
    if (!(c.start >= 0 && c.start < c.end && c.end <= 1))
      throw Error(at + ": start " + std::to_string(c.start) + " and end " + std::to_string(c.end) +
                  " must satisfy 0 <= start < end <= 1");
  }
  try {
    job::StrategyParams sp{p.strategy, p.devices, p.skip, 0};
    sp.cache_threshold = p.cache_threshold;
    parallel::make_strategy(sp);
  } catch (const Error& e) {
    throw Error(field(where, "strategy") + ": " + e.what());
  }
}

Preset parse_preset(const std::string& json_text, const std::string& where) {
  const json j = io::parse_json(json_text, where);
  if (!j.is_object()) throw Error(where + ": a preset must be a JSON object, not " + std::string(j.type_name()));
  const io::JsonFields f(j, where);
  f.only(kKeys);
  Preset p;
  p.name = f.text("name", true);
  p.description = f.text("description", false);
  p.prompt_template = f.text("prompt_template", true);
  p.negative_prompt = f.text("negative_prompt", false);
  p.width = f.integer("width", true, 0);
  p.height = f.integer("height", true, 0);
  p.steps = f.integer("steps", true, 30);
  p.sampler = f.text("sampler", true);
  p.cfg = f.number("cfg", true, 7.0);
  p.guidance = f.number("guidance", false, 3.5);
  p.strategy = f.text("strategy", false, "single");
  p.devices = f.integer("devices", false, 1);
  const auto* info = parallel::find_strategy(p.strategy);
  if (info && info->takes(parallel::Param::Skip) && !f.has("skip") && p.devices > 1) {
    p.skip = p.devices;  // written before step-skip had a skip field of its own
    p.devices = 1;
  } else {
    p.skip = f.integer("skip", false, 2);
  }
  p.cache_threshold = f.number("cache_threshold", false, job::StrategyParams{}.cache_threshold);
  p.precision = f.text("precision", false);
  if (!p.precision.empty() && p.precision != "bf16" && p.precision != "fp8")
    throw Error(f.field("precision") + ": '" + p.precision.substr(0, 40) + "' is neither bf16 nor fp8");
  if (f.has("cache_threshold") && !(p.cache_threshold >= 0))
    throw Error(f.field("cache_threshold") + ": cache threshold " + std::to_string(p.cache_threshold) +
                " must be between 0 (never reuse) and 10");
  const auto entry = [&](const json& e, const char* list, int n, const std::set<std::string>& known) {
    const auto at = field(where, list) + " entry " + std::to_string(n);
    if (!e.is_object()) throw Error(at + " must be an object, not " + io::json_brief(e));
    io::JsonFields fields(e, at);
    fields.only(known);
    return fields;
  };
  int n = 0;
  for (const auto& e : f.list("loras")) {
    const auto l_f = entry(e, "loras", ++n, {"name", "weight", "text_encoder_weight"});
    Preset::Lora l;
    l.name = l_f.text("name", true);
    l.weight = l_f.number("weight", false, 1.0);
    l.text_encoder_weight = l_f.number("text_encoder_weight", false, l.weight);
    p.loras.push_back(l);
  }
  n = 0;
  for (const auto& e : f.list("controlnets")) {
    const auto c_f = entry(e, "controlnets", ++n, {"model", "preprocessor", "low", "high", "scale", "start", "end"});
    Preset::ControlNet c;
    c.model = c_f.text("model", true);
    c.preprocessor = c_f.text("preprocessor", false, "none");
    c.low = c_f.integer("low", false, 100);
    c.high = c_f.integer("high", false, 200);
    c.scale = c_f.number("scale", false, 1.0);
    c.start = c_f.number("start", false, 0.0);
    c.end = c_f.number("end", false, 1.0);
    p.controlnets.push_back(c);
  }
  validate_preset(p, where);
  return p;
}

Preset load_preset(const fs::path& file) {
  return parse_preset(io::read_file(file, 1 << 20, "preset"), file.string());
}

std::string preset_to_json(const Preset& p) {
  json j = {{"name", p.name},
            {"prompt_template", p.prompt_template},
            {"negative_prompt", p.negative_prompt},
            {"width", p.width},
            {"height", p.height},
            {"steps", p.steps},
            {"sampler", p.sampler},
            {"cfg", p.cfg},
            {"guidance", p.guidance},
            {"strategy", p.strategy.empty() ? "single" : p.strategy},
            {"devices", p.devices}};
  if (const auto* info = parallel::find_strategy(p.strategy); info && info->takes(parallel::Param::Skip))
    j["skip"] = p.skip;
  if (const auto* info = parallel::find_strategy(p.strategy);
      info && info->takes(parallel::Param::CacheThreshold) && p.cache_threshold >= 0)
    j["cache_threshold"] = p.cache_threshold;
  if (!p.description.empty()) j["description"] = p.description;
  if (!p.precision.empty()) j["precision"] = p.precision;
  for (const auto& l : p.loras)
    j["loras"].push_back({{"name", l.name}, {"weight", l.weight}, {"text_encoder_weight", l.text_encoder_weight}});
  for (const auto& c : p.controlnets) {
    json e = {{"model", c.model}, {"preprocessor", c.preprocessor}, {"scale", c.scale}, {"start", c.start}, {"end", c.end}};
    if (c.preprocessor == "canny") {
      e["low"] = c.low;
      e["high"] = c.high;
    }
    j["controlnets"].push_back(e);
  }
  return j.dump(2) + "\n";
}

void save_preset(const Preset& preset, const fs::path& file) {
  validate_preset(preset, file.string());
  io::write_file_atomically(file, preset_to_json(preset));
}

std::string fill_prompt_template(const std::string& prompt_template, const std::string& subject) {
  const std::string placeholder = kSubjectPlaceholder;
  std::string out;
  std::size_t from = 0;
  for (std::size_t at; (at = prompt_template.find(placeholder, from)) != std::string::npos; from = at + placeholder.size())
    out += prompt_template.substr(from, at - from) + subject;
  return out + prompt_template.substr(from);
}

void apply_preset(const Preset& preset, const std::string& subject, job::GenerationRequest& request) {
  request.prompt = fill_prompt_template(preset.prompt_template, subject);
  request.negative_prompt = preset.negative_prompt;
  request.width = preset.width;
  request.height = preset.height;
  request.steps = preset.steps;
  request.sampler = preset.sampler;
  request.cfg = preset.cfg;
  request.guidance = preset.guidance;
  request.strategy.name = preset.strategy;
  request.strategy.devices = preset.devices;
  request.strategy.skip = preset.skip;
  request.strategy.cache_threshold = preset.cache_threshold;
  request.precision = preset.precision;
  for (const auto& l : preset.loras) {
    job::LoraRef ref;
    ref.name = l.name;
    ref.weight = l.weight;
    ref.text_encoder_weight = l.text_encoder_weight;
    request.loras.push_back(ref);
  }
}

Preset preset_from_request(const std::string& name, const std::string& prompt_template,
                           const job::GenerationRequest& request) {
  Preset p;
  p.name = name;
  p.prompt_template = prompt_template;
  p.negative_prompt = request.negative_prompt;
  p.width = request.width;
  p.height = request.height;
  p.steps = request.steps;
  p.sampler = request.sampler;
  p.cfg = request.cfg;
  p.guidance = request.guidance;
  p.strategy = request.strategy.display_name();
  const auto* info = parallel::find_strategy(p.strategy);
  if (info && info->takes(parallel::Param::Skip)) {
    p.skip = request.strategy.skip;
  } else {
    p.devices = request.strategy.devices;
  }
  p.cache_threshold = request.strategy.cache_threshold;
  p.precision = request.precision == "fp8" ? "fp8" : "";
  for (const auto& l : request.loras) {
    Preset::Lora e;
    e.name = l.name.empty() ? fs::path(l.path).stem().string() : l.name;
    e.weight = l.weight;
    e.text_encoder_weight = l.text_encoder_weight;
    p.loras.push_back(e);
  }
  for (const auto& c : request.controlnets) {
    Preset::ControlNet e;
    e.model = c.path;
    e.scale = c.scale;
    e.start = c.start;
    e.end = c.end;
    p.controlnets.push_back(e);
  }
  return p;
}

std::string preset_file_name(const std::string& name) {
  std::string out;
  for (unsigned char c : name) {
    if (std::isalnum(c)) out += static_cast<char>(std::tolower(c));
    else if (!out.empty() && out.back() != '-') out += '-';
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return (out.empty() ? std::string("preset") : out) + ".json";
}

Preset find_preset(const std::string& name_or_file, const std::vector<fs::path>& dirs) {
  const fs::path as_path(name_or_file);
  if (as_path.extension() == ".json" || as_path.has_parent_path()) {
    if (!fs::is_regular_file(as_path)) throw Error("preset " + name_or_file + ": no such file");
    return load_preset(as_path);
  }
  const std::string wanted = lower(name_or_file);
  std::string available;
  std::vector<fs::path> seen;
  for (const auto& dir : dirs) {
    for (const auto& f : io::files_in(dir, ".json")) {
      const bool stem_matches = lower(f.stem().string()) == wanted;
      Preset p;
      try {
        p = load_preset(f);
      } catch (const Error&) {
        if (stem_matches) throw;  // the one asked for is broken: say why
        continue;
      }
      if (stem_matches || lower(p.name) == wanted) return p;
      if (std::find(seen.begin(), seen.end(), f.stem()) != seen.end()) continue;  // shadowed by an earlier folder
      seen.push_back(f.stem());
      available += (available.empty() ? "" : ", ") + f.stem().string();
    }
  }
  std::string searched;
  for (const auto& d : dirs) searched += (searched.empty() ? "" : ", ") + d.string();
  throw Error("no preset named '" + name_or_file + "' in " + (searched.empty() ? "no folder" : searched) +
              (available.empty() ? " (no presets there)" : " (available: " + available + ")"));
}

}  // namespace diffract::engine
