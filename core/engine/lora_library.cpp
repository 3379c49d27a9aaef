#include "core/engine/lora_library.h"

#include <algorithm>
#include <cctype>
#include <map>

#include <nlohmann/json.hpp>

#include "core/engine/model_discovery.h"
#include "core/io/lora_file.h"
#include "core/io/safetensors.h"
#include "core/text/prompt_syntax.h"
#include "core/util/embedded_model.h"
#include "core/util/error.h"

namespace diffract::engine {

namespace fs = std::filesystem;

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const auto up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

bool is_safetensors(const fs::directory_entry& e) {
  std::error_code ec;
  return e.is_regular_file(ec) && e.path().extension() == ".safetensors";
}

}  // namespace

std::vector<fs::path> find_lora_files(const std::vector<std::string>& dirs, const fs::path& hub) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& d : dirs) {
    if (!fs::is_directory(d, ec)) continue;
    std::vector<fs::path> here;
    for (auto it = fs::recursive_directory_iterator(d, fs::directory_options::skip_permission_denied, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
      if (is_safetensors(*it)) here.push_back(it->path());
    std::sort(here.begin(), here.end());
    out.insert(out.end(), here.begin(), here.end());
  }
  if (!hub.empty() && fs::is_directory(hub, ec)) {
    std::vector<fs::path> here;
    for (const auto& repo : fs::directory_iterator(hub, ec)) {
      const auto snapshots = repo.path() / "snapshots";
      if (!fs::is_directory(snapshots, ec)) continue;
      for (const auto& snap : fs::directory_iterator(snapshots, ec))
        for (const auto& f : fs::directory_iterator(snap.path(), ec))
          if (is_safetensors(f)) here.push_back(f.path());
    }
    std::sort(here.begin(), here.end());
    out.insert(out.end(), here.begin(), here.end());
  }
  return out;
}

fs::path find_lora(const std::string& name, const std::vector<fs::path>& files, const std::vector<std::string>& dirs) {
  std::error_code ec;
  if (name.find('/') != std::string::npos && fs::is_regular_file(name, ec)) return name;
  const auto want = lower(name);
  for (const auto& f : files)
    if (lower(f.stem().string()) == want) return f;
  std::vector<std::pair<std::size_t, std::string>> near;
  for (const auto& f : files) near.emplace_back(edit_distance(want, lower(f.stem().string())), f.stem().string());
  std::sort(near.begin(), near.end());
  std::string where = dirs.empty() ? std::string("no LoRA folder is set (--lora-dir, or Settings)") : "looked in";
  for (const auto& d : dirs) where += " " + d;
  where += " and the Hugging Face cache";
  std::string msg = "no LoRA named '" + name + "': " + where + "; ";
  if (near.empty()) throw Error(msg + "no LoRA files were found there");
  msg += "nearest: ";
  for (std::size_t i = 0; i < near.size() && i < 3; ++i) msg += (i ? ", " : "") + near[i].second;
  throw Error(msg);
}

LoraFileInfo read_lora_info(const fs::path& file) {
  LoraFileInfo info;
  info.path = file;
  info.name = file.stem().string();
  try {
    const auto archive = io::SafetensorsArchive::open(file);
    const auto& meta = archive->metadata();
    if (const auto it = meta.find("ss_base_model_version"); it != meta.end()) info.base_model = it->second;
    if (const auto it = meta.find("ss_tag_frequency"); it != meta.end()) {
      // {"dataset folder": {"tag": count, ...}, ...}: counts summed over the folders.
      std::map<std::string, double> counts;
      const auto j = nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
      if (j.is_object())
        for (const auto& [folder, tags] : j.items())
          if (tags.is_object())
            for (const auto& [tag, n] : tags.items())
              if (n.is_number()) counts[tag] += n.get<double>();
      std::vector<std::pair<double, std::string>> order;
      for (const auto& [tag, n] : counts) order.emplace_back(-n, tag);
      std::sort(order.begin(), order.end());
      for (std::size_t i = 0; i < order.size() && i < 8; ++i) {
        auto tag = order[i].second;
        const auto a = tag.find_first_not_of(' '), b = tag.find_last_not_of(' ');
        if (a != std::string::npos) info.trigger_words.push_back(tag.substr(a, b - a + 1));
      }
    }
  } catch (const std::exception& e) {
    info.error = e.what();
  }
  return info;
}

std::string lora_short_hash(const fs::path& file) { return io::lora_file_hash(file).substr(0, 12); }

void resolve_lora_tags(job::GenerationRequest& request) {
  std::vector<text::ExtraNetworkTag> tags;
  if (request.prompt_syntax == job::PromptSyntax::A1111) tags = text::extract_extra_networks(request.prompt).tags;
  const bool unnamed = std::any_of(request.loras.begin(), request.loras.end(), [](const job::LoraRef& l) { return l.path.empty(); });
  if (tags.empty() && !unnamed) return;
  // The LoRAs shipped with the embedded model are found after the request's folders.
  auto dirs = request.lora_dirs;
  if (const auto shipped = embedded_lora_dir(); !shipped.empty()) dirs.push_back(shipped.string());
  const auto files = find_lora_files(dirs, hugging_face_hub());
  for (auto& l : request.loras)
    if (l.path.empty()) l.path = find_lora(l.name, files, dirs).string();
  for (const auto& t : tags) {
    if (std::any_of(request.loras.begin(), request.loras.end(), [&](const job::LoraRef& l) { return l.name == t.name; }))
      continue;
    job::LoraRef ref;
    ref.path = find_lora(t.name, files, dirs).string();
    ref.name = t.name;
    ref.weight = t.weight;
    ref.text_encoder_weight = t.text_encoder_weight;
    request.loras.push_back(ref);
  }
}

}  // namespace diffract::engine
