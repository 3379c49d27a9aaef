#include "core/engine/output.h"

#include <atomic>
#include <cstdio>
#include <random>
#include <system_error>

#include <nlohmann/json.hpp>

#include "core/util/error.h"
#include "core/util/options.h"

namespace fs = std::filesystem;

namespace diffract::engine {

fs::path output_dir(const fs::path& fallback) {
  if (options::is_set(options::Id::OutputDir)) return options::value(options::Id::OutputDir);
  return fallback;
}

fs::path batch_file(const fs::path& out, int index, int count) {
  if (count == 1) return out;
  return out.parent_path() / (out.stem().string() + "_" + std::to_string(index) + out.extension().string());
}

BatchImageText batch_image_text(const std::string& parameters, const std::string& metadata_json, int index, int count) {
  if (count <= 1) return {parameters, metadata_json};
  BatchImageText out{parameters, metadata_json};
  if (!parameters.empty())
    out.parameters += ", Batch size: " + std::to_string(count) + ", Batch pos: " + std::to_string(index);
  auto meta = nlohmann::json::parse(metadata_json, nullptr, /*allow_exceptions=*/false);
  if (meta.is_object()) {
    meta["batch_index"] = index;
    out.metadata_json = meta.dump();
  }
  return out;
}

std::string output_stamp(std::time_t t) {
  std::tm local{};
  localtime_r(&t, &local);
  char text[32];
  std::strftime(text, sizeof text, "%Y%m%d-%H%M%S", &local);
  return text;
}

fs::path unused_output_file(const fs::path& dir, const std::string& stamp, const std::string& seed, int index) {
  const std::string base = stamp + "-" + seed + "-" + std::to_string(index);
  for (int n = 0;; ++n) {
    fs::path path = dir / (base + (n ? "-" + std::to_string(n) : std::string()) + ".png");
    std::error_code ec;
    if (!fs::exists(path, ec)) return path;
  }
}

void save_image(const fs::path& path, const io::Image& image, const std::string& parameters,
                const std::string& metadata_json) {
  save_png(path, image, {{"parameters", parameters}, {"diffract", metadata_json}});
}

void save_png(const fs::path& path, const io::Image& image, const io::PngText& text) {
  // Hidden and not *.png, so a folder watcher (the gallery) never lists it; unique per call, so
  // two writers of one name do not share a temporary file.
  static std::atomic<unsigned> counter{0};
  char unique[40];
  std::snprintf(unique, sizeof unique, "%08x%04x", static_cast<unsigned>(std::random_device{}()),
                counter.fetch_add(1) & 0xffffu);
  const fs::path temporary = path.parent_path() / ("." + path.filename().string() + "." + unique + ".tmp");
  try {
    io::write_png(temporary, image, text);
    fs::rename(temporary, path);
  } catch (const std::exception& e) {
    std::error_code ignored;
    fs::remove(temporary, ignored);
    // The reason names the file the caller asked for, not the temporary one.
    std::string why = e.what();
    if (why.rfind(temporary.string() + ": ", 0) == 0) why = why.substr(temporary.string().size() + 2);
    throw Error(path.string() + ": " + why);
  }
}

std::string save_inputs_beside(const fs::path& png, const job::ImageInputs& in,
                               const std::vector<job::ControlNetRef>& controlnets, const std::string& metadata_json) {
  if (!in.has_image() && controlnets.empty()) return metadata_json;
  auto meta = nlohmann::json::parse(metadata_json);
  const fs::path folder = png.parent_path() / "inputs";
  fs::create_directories(folder);
  const std::string stem = png.stem().string();
  const auto write = [&](const io::Image& img, const std::string& suffix) {
    const fs::path file = folder / (stem + suffix);
    save_image(file, img, "", "{}");
    return (fs::path("inputs") / file.filename()).generic_string();
  };
  if (in.has_image()) {
    meta["input"]["input_file"] = write(in.image, ".input.png");
    if (in.has_mask()) meta["input"]["mask_file"] = write(in.mask, ".mask.png");
  }
  for (std::size_t i = 0; i < controlnets.size(); ++i) {
    const auto& c = controlnets[i];
    if (c.image.rgb.empty()) continue;
    auto& list = meta["controlnets"];
    if (!list.is_array() || list.size() <= i)  // the pipeline wrote none (a failed job): the request's
      list.push_back({{"path", c.path}, {"scale", c.scale}, {"start", c.start}, {"end", c.end}});
    list[i]["image_file"] = write(c.image, ".control" + std::to_string(i + 1) + ".png");
  }
  return meta.dump();
}

}  // namespace diffract::engine
