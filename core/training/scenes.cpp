#include "core/training/scenes.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "core/io/image.h"
#include "core/util/error.h"

namespace diffract::training {

namespace fs = std::filesystem;

namespace {

std::vector<std::string> split_tabs(const std::string& line) {
  std::vector<std::string> out;
  std::string field;
  std::istringstream in(line);
  while (std::getline(in, field, '\t')) out.push_back(field);
  if (!line.empty() && line.back() == '\t') out.emplace_back();
  return out;
}

// Emoji names as ASCII: the tokenizer of an ICU-less build (the GPU machine) takes nothing
// else, and the few accented names ("piñata", "Côte d’Ivoire") read fine without.
std::string ascii_name(const std::string& name) {
  static const std::vector<std::pair<std::string, std::string>> folds = {
      {"\u2019", "'"}, {"\u2018", "'"}, {"\u201c", "\""}, {"\u201d", "\""}, {"\u00c5", "A"}, {"\u00e3", "a"},
      {"\u00e7", "c"}, {"\u00e9", "e"}, {"\u00ed", "i"},   {"\u00f1", "n"},   {"\u00f4", "o"}, {"\u00e8", "e"},
      {"\u00fc", "u"}, {"\u00f6", "o"}, {"\u00e1", "a"},   {"\u00f3", "o"}};
  std::string out;
  for (std::size_t i = 0; i < name.size();) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c < 0x80) {
      out += name[i++];
      continue;
    }
    bool folded = false;
    for (const auto& [from, to] : folds)
      if (name.compare(i, from.size(), from) == 0) {
        out += to;
        i += from.size();
        folded = true;
        break;
      }
    if (!folded) throw Error("emoji name '" + name + "' has a character with no ASCII spelling here");
  }
  return out;
}

bool starts_with_vowel(const std::string& s) {
  return !s.empty() && std::string("aeiouAEIOU").find(s[0]) != std::string::npos;
}

template <class T>
int index_of(const std::vector<T>& names, const std::string& name, const std::string& where) {
  for (std::size_t i = 0; i < names.size(); ++i) {
    if constexpr (std::is_same_v<T, NamedColour>) {
      if (names[i].name == name) return static_cast<int>(i);
    } else {
      if (names[i] == name) return static_cast<int>(i);
    }
  }
  throw Error(where + ": unknown setting '" + name + "'");
}

}  // namespace

SpriteAtlas SpriteAtlas::load(const fs::path& dir, int64_t limit) {
  const auto meta_path = dir / "atlas.json";
  std::ifstream meta_in(meta_path);
  if (!meta_in) throw Error(meta_path.string() + ": missing (make the atlas with diffract-dataset)");
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(meta_in);
  } catch (const std::exception& e) {
    throw Error(meta_path.string() + ": not valid JSON: " + e.what());
  }
  int64_t size = 0, columns = 0, count = 0;
  std::vector<std::string> sheets;
  try {
    size = meta.at("sprite_size").get<int64_t>();
    columns = meta.at("columns").get<int64_t>();
    count = meta.at("count").get<int64_t>();
    sheets = meta.at("sheets").get<std::vector<std::string>>();
  } catch (const std::exception& e) {
    throw Error(meta_path.string() + ": needs sprite_size, columns, count and sheets (" + e.what() + ")");
  }
  if (size < 8 || columns < 1 || count < 1 || sheets.empty())
    throw Error(meta_path.string() + ": sprite_size, columns, count and sheets must be positive");

  SpriteAtlas atlas;
  atlas.source_ = dir;
  const auto index_path = dir / "index.tsv";
  std::ifstream index(index_path);
  if (!index) throw Error(index_path.string() + ": missing");
  std::string line;
  int line_no = 0;
  while (std::getline(index, line)) {
    ++line_no;
    if (line_no == 1 || line.empty()) continue;  // header
    const auto f = split_tabs(line);
    if (f.size() != 5 || f[2].empty())
      throw Error(index_path.string() + ":" + std::to_string(line_no) + ": expected id, codepoints, name, group, subgroup");
    if (std::stoll(f[0]) != static_cast<int64_t>(atlas.sprites_.size()))
      throw Error(index_path.string() + ":" + std::to_string(line_no) + ": ids must count up from 0");
    try {
      atlas.sprites_.push_back({f[1], ascii_name(f[2]), f[3], f[4]});
    } catch (const Error& e) {
      throw Error(index_path.string() + ":" + std::to_string(line_no) + ": " + e.what());
    }
  }
  if (static_cast<int64_t>(atlas.sprites_.size()) != count)
    throw Error(index_path.string() + ": lists " + std::to_string(atlas.sprites_.size()) + " sprites, atlas.json says " +
                std::to_string(count));
  const int64_t per_sheet = columns * columns;
  if (static_cast<int64_t>(sheets.size()) * per_sheet < count)
    throw Error(meta_path.string() + ": " + std::to_string(sheets.size()) + " sheets cannot hold " + std::to_string(count) +
                " sprites");
  const int64_t n = limit > 0 ? std::min(limit, count) : count;
  atlas.sprites_.resize(static_cast<std::size_t>(n));
  atlas.pixels_ = at::empty({n, 4, size, size}, at::kByte);
  for (int64_t s = 0; s * per_sheet < n; ++s) {
    const auto sheet_path = dir / sheets[static_cast<std::size_t>(s)];
    const auto img = io::read_png_rgba(sheet_path);
    if (img.width != columns * size || img.height != columns * size)
      throw Error(sheet_path.string() + ": is " + std::to_string(img.width) + "x" + std::to_string(img.height) +
                  ", expected " + std::to_string(columns * size) + " a side");
    auto sheet = at::from_blob(const_cast<std::uint8_t*>(img.rgba.data()), {columns, size, columns, size, 4}, at::kByte)
                     .permute({0, 2, 4, 1, 3})
                     .reshape({per_sheet, 4, size, size});
    const int64_t take = std::min(per_sheet, n - s * per_sheet);
    atlas.pixels_.narrow(0, s * per_sheet, take).copy_(sheet.narrow(0, 0, take));
  }
  return atlas;
}

SpriteAtlas SpriteAtlas::from_pixels(at::Tensor pixels, std::vector<SpriteInfo> sprites) {
  if (pixels.dim() != 4 || pixels.size(1) != 4 || pixels.size(2) != pixels.size(3) ||
      pixels.size(0) != static_cast<int64_t>(sprites.size()) || pixels.scalar_type() != at::kByte)
    throw Error("sprite atlas: pixels must be uint8 [N, 4, S, S] with one description per sprite");
  SpriteAtlas atlas;
  atlas.pixels_ = std::move(pixels);
  atlas.sprites_ = std::move(sprites);
  atlas.source_ = "<memory>";
  return atlas;
}

int64_t SpriteAtlas::find(const std::string& name) const {
  for (std::size_t i = 0; i < sprites_.size(); ++i)
    if (sprites_[i].name == name) return static_cast<int64_t>(i);
  return -1;
}

const std::vector<NamedColour>& background_colours() {
  static const std::vector<NamedColour> colours = {
      {"white", {255, 255, 255}},      {"light blue", {173, 216, 230}}, {"pink", {255, 182, 193}},
      {"yellow", {255, 230, 80}},      {"light green", {150, 230, 150}}, {"grey", {128, 128, 128}},
      {"black", {0, 0, 0}},            {"orange", {255, 150, 40}},       {"purple", {128, 60, 170}},
      {"beige", {235, 220, 185}},      {"dark blue", {20, 40, 120}},     {"red", {210, 30, 40}},
  };
  return colours;
}

const std::vector<std::string>& scale_names() {
  static const std::vector<std::string> names = {"small", "medium", "large"};
  return names;
}

const std::vector<std::string>& position_names() {
  static const std::vector<std::string> names = {"centre", "top left", "top right", "bottom left", "bottom right"};
  return names;
}

int64_t scale_pixels(int scale, int64_t image_size) {
  static constexpr double kFraction[] = {0.3125, 0.5, 0.78125};  // 40, 64, 100 px of 128
  return static_cast<int64_t>(kFraction[scale] * static_cast<double>(image_size) + 0.5);
}

bool valid_placement(int scale, int position) { return scale != 2 || position == 0; }

std::string caption(const std::string& name, const SceneSpec& s, CaptionParts parts) {
  if (!parts.scale && !parts.position && !parts.colour) return name;
  std::string out;
  if (parts.scale) {
    out = "a " + scale_names()[static_cast<std::size_t>(s.scale)] + " " + name;
  } else {
    out = (starts_with_vowel(name) ? "an " : "a ") + name;
  }
  if (parts.position) out += " in the " + position_names()[static_cast<std::size_t>(s.position)];
  if (parts.colour) {
    const auto& c = background_colours()[static_cast<std::size_t>(s.colour)].name;
    out += std::string(starts_with_vowel(c) ? " on an " : " on a ") + c + " background";
  }
  return out;
}

void HoldOut::add(const SceneSpec& s) {
  if (set_.insert(s).second) specs_.push_back(s);
}

HoldOut HoldOut::make(const SpriteAtlas& atlas, int count, std::uint64_t seed) {
  HoldOut h;
  std::mt19937_64 rng(seed);
  std::set<int64_t> used;
  const int64_t colours = static_cast<int64_t>(background_colours().size());
  if (count > atlas.size()) throw Error("hold-out: " + std::to_string(count) + " combinations need as many emoji");
  while (static_cast<int>(h.specs_.size()) < count) {
    SceneSpec s;
    s.emoji = static_cast<int64_t>(rng() % static_cast<std::uint64_t>(atlas.size()));
    s.colour = static_cast<int>(rng() % static_cast<std::uint64_t>(colours));
    s.scale = static_cast<int>(rng() % 3);
    s.position = s.scale == 2 ? 0 : static_cast<int>(rng() % 5);
    if (!used.insert(s.emoji).second) continue;
    h.add(s);
  }
  return h;
}

HoldOut HoldOut::load(const fs::path& file, const SpriteAtlas& atlas) {
  std::ifstream in(file);
  if (!in) throw Error(file.string() + ": cannot open the hold-out list");
  HoldOut h;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line_no == 1 || line.empty()) continue;
    const auto where = file.string() + ":" + std::to_string(line_no);
    const auto f = split_tabs(line);
    if (f.size() != 4) throw Error(where + ": expected name, colour, scale, position");
    SceneSpec s;
    s.emoji = atlas.find(f[0]);
    if (s.emoji < 0) throw Error(where + ": emoji '" + f[0] + "' is not in the atlas " + atlas.source().string());
    s.colour = index_of(background_colours(), f[1], where);
    s.scale = index_of(scale_names(), f[2], where);
    s.position = index_of(position_names(), f[3], where);
    if (!valid_placement(s.scale, s.position)) throw Error(where + ": large sprites are only centred");
    h.add(s);
  }
  return h;
}

void HoldOut::save(const fs::path& file, const SpriteAtlas& atlas) const {
  std::ofstream out(file);
  if (!out) throw Error(file.string() + ": cannot write");
  out << "name\tcolour\tscale\tposition\n";
  for (const auto& s : specs_)
    out << atlas.sprites()[static_cast<std::size_t>(s.emoji)].name << '\t'
        << background_colours()[static_cast<std::size_t>(s.colour)].name << '\t'
        << scale_names()[static_cast<std::size_t>(s.scale)] << '\t'
        << position_names()[static_cast<std::size_t>(s.position)] << '\n';
}

const std::vector<std::string>& scene_styles() {
  static const std::vector<std::string> styles = {"", "outline"};
  return styles;
}

at::Tensor outline_lines(const at::Tensor& premultiplied) {
  const auto dilate = [](const at::Tensor& x) { return at::max_pool2d(x, {3, 3}, {1, 1}, {1, 1}); };
  const auto erode = [&](const at::Tensor& x) { return -dilate(-x); };
  const auto alpha = premultiplied.narrow(1, 3, 1);
  const auto solid = alpha.gt(0.5).to(alpha.scalar_type());
  // The silhouette's edge, and edges between colours inside it (eyes, stripes, letters).
  const auto silhouette = dilate(alpha) - erode(alpha);
  const auto straight = premultiplied.narrow(1, 0, 3) / alpha.clamp_min(1e-3) * solid;
  const auto contrast = std::get<0>((dilate(straight) - erode(straight)).max(1, /*keepdim=*/true));
  const auto inner = ((contrast - 0.3) / 0.2).clamp(0, 1) * erode(solid);
  return at::maximum(silhouette, inner).clamp(0, 1);
}

SceneComposer::SceneComposer(const SpriteAtlas& atlas, HoldOut holdout, SceneOptions options, c10::Device device)
    : atlas_(atlas), holdout_(std::move(holdout)), options_(options), device_(device) {
  if (atlas.size() == 0) throw Error("scene composer: the atlas holds no sprites");
  const auto& styles = scene_styles();
  if (std::find(styles.begin(), styles.end(), options_.style) == styles.end())
    throw Error("scene style '" + options_.style + "' is not outline (or empty: the emoji as drawn)");
  const bool outline = options_.style == "outline";
  at::NoGradGuard no_grad;
  for (int scale = 0; scale < 3; ++scale) {
    const int64_t side = scale_pixels(scale, options_.image_size);
    std::vector<at::Tensor> chunks;
    for (int64_t i = 0; i < atlas.size(); i += 256) {
      auto px = atlas.pixels().narrow(0, i, std::min<int64_t>(256, atlas.size() - i)).to(device).to(at::kFloat) / 255.0;
      auto alpha = px.narrow(1, 3, 1);
      auto premult = at::cat({px.narrow(1, 0, 3) * alpha, alpha}, 1);
      auto scaled = at::_upsample_bilinear2d_aa(premult, {side, side}, false, std::nullopt, std::nullopt).clamp(0, 1);
      chunks.push_back(outline ? outline_lines(scaled) : scaled);
    }
    scaled_.push_back(at::cat(chunks));
  }
  std::vector<float> rgb;
  for (const auto& c : background_colours())
    for (auto v : c.rgb) rgb.push_back(static_cast<float>(v) / 255.0f);
  colours_ = at::tensor(rgb).view({-1, 3}).to(device);
  // Near-black ink on light backgrounds, near-white on dark ones (Rec. 709 luma).
  const auto luma = colours_.matmul(at::tensor({0.2126f, 0.7152f, 0.0722f}, colours_.options()));
  inks_ = at::where(luma.gt(0.45).unsqueeze(1), at::full({1, 3}, 0.08f, colours_.options()),
                    at::full({1, 3}, 0.95f, colours_.options()));
  for (int s = 0; s < 3; ++s)
    for (int p = 0; p < 5; ++p)
      if (valid_placement(s, p)) placements_.emplace_back(s, p);
}

std::vector<SceneSpec> SceneComposer::sample(int64_t n, std::mt19937_64& rng) const {
  std::vector<SceneSpec> out;
  out.reserve(static_cast<std::size_t>(n));
  const auto colours = static_cast<std::uint64_t>(background_colours().size());
  while (static_cast<int64_t>(out.size()) < n) {
    SceneSpec s;
    s.emoji = static_cast<int64_t>(rng() % static_cast<std::uint64_t>(atlas_.size()));
    s.colour = static_cast<int>(rng() % colours);
    const auto& [scale, position] = placements_[rng() % placements_.size()];
    s.scale = scale;
    s.position = position;
    if (!holdout_.contains(s)) out.push_back(s);
  }
  return out;
}

std::vector<SceneSpec> SceneComposer::all() const {
  std::vector<SceneSpec> out;
  const int colours = static_cast<int>(background_colours().size());
  for (int64_t e = 0; e < atlas_.size(); ++e)
    for (int c = 0; c < colours; ++c)
      for (const auto& [scale, position] : placements_) {
        const SceneSpec s{e, c, scale, position};
        if (!holdout_.contains(s)) out.push_back(s);
      }
  return out;
}

at::Tensor SceneComposer::render(const std::vector<SceneSpec>& specs, std::mt19937_64* rng) const {
  at::NoGradGuard no_grad;
  const int64_t size = options_.image_size, n = static_cast<int64_t>(specs.size());
  // One host-to-device copy per batch (emoji, colour, placement); every placement is then
  // blended under a mask, so nothing waits for the device.
  auto table = at::empty({3, n}, at::kLong);
  auto* t = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const auto& s = specs[static_cast<std::size_t>(i)];
    t[i] = s.emoji;
    t[n + i] = s.colour;
    t[2 * n + i] = s.scale * 8 + s.position;
  }
  table = table.to(device_);
  const auto emoji = table[0], placement = table[2];
  auto images = colours_.index_select(0, table[1]).view({n, 3, 1, 1}).repeat({1, 1, size, size});
  const auto inked = options_.style == "outline" ? inks_.index_select(0, table[1]).view({n, 3, 1, 1}) : at::Tensor();
  for (const auto& [scale, position] : placements_) {
    auto [x, y, side] = sprite_box({0, 0, scale, position});
    if (rng && options_.jitter > 0) {
      const auto span = static_cast<std::uint64_t>(2 * options_.jitter + 1);
      x = std::clamp<int64_t>(x + static_cast<int64_t>((*rng)() % span) - options_.jitter, 0, size - side);
      y = std::clamp<int64_t>(y + static_cast<int64_t>((*rng)() % span) - options_.jitter, 0, size - side);
    }
    const auto here = placement.eq(scale * 8 + position).to(at::kFloat).view({n, 1, 1, 1});
    auto sprite = scaled_[static_cast<std::size_t>(scale)].index_select(0, emoji);
    auto region = images.narrow(2, y, side).narrow(3, x, side);
    if (inked.defined()) {
      const auto alpha = sprite * here;
      region.copy_(region * (1 - alpha) + inked * alpha);
    } else {
      const auto alpha = sprite.narrow(1, 3, 1) * here;
      region.copy_(region * (1 - alpha) + sprite.narrow(1, 0, 3) * here);
    }
  }
  return images;
}

std::array<int64_t, 3> SceneComposer::sprite_box(const SceneSpec& spec) const {
  const int64_t size = options_.image_size, margin = size / 21, side = scale_pixels(spec.scale, size);
  const int64_t far = size - side - margin, mid = (size - side) / 2;
  const int p = spec.position;
  const int64_t x = p == 0 ? mid : (p == 1 || p == 3) ? margin : far;
  const int64_t y = p == 0 ? mid : (p == 1 || p == 2) ? margin : far;
  return {x, y, side};
}

at::Tensor SceneComposer::inpainting_masks(const at::Tensor& images, const std::vector<SceneSpec>& specs,
                                           std::mt19937_64& rng) const {
  at::NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(specs.size()), size = images.size(-1);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  // Per image: kind (0 emoji, 1 box, 2 ellipse, 3 stroke, 4 all) and six numbers in pixels.
  auto params = at::zeros({n, 7}, at::kFloat);
  auto* p = params.data_ptr<float>();
  const double s = static_cast<double>(size);
  for (int64_t i = 0; i < n; ++i) {
    const double k = u(rng);
    const int kind = k < 0.35 ? 0 : k < 0.55 ? 1 : k < 0.7 ? 2 : k < 0.9 ? 3 : 4;
    float* q = p + i * 7;
    q[0] = static_cast<float>(kind);
    const double w = (0.15 + 0.6 * u(rng)) * s, h = (0.15 + 0.6 * u(rng)) * s;  // box / ellipse extent
    const double cx = w / 2 + u(rng) * (s - w), cy = h / 2 + u(rng) * (s - h);
    q[1] = static_cast<float>(cx), q[2] = static_cast<float>(cy), q[3] = static_cast<float>(w / 2),
    q[4] = static_cast<float>(h / 2);
    if (kind == 3) {  // a stroke: a segment of random length and direction, thick as a brush
      q[3] = static_cast<float>(u(rng) * s), q[4] = static_cast<float>(u(rng) * s);
      q[5] = static_cast<float>((0.04 + 0.08 * u(rng)) * s);
    }
  }
  params = params.to(images.device());
  const auto col = [&](int j) { return params.select(1, j).view({n, 1, 1}); };
  const auto coords = at::arange(size, images.options()).add(0.5);
  const auto X = coords.view({1, 1, size}), Y = coords.view({1, size, 1});
  const auto kind = col(0);
  const auto box = ((X - col(1)).abs() <= col(3)) & ((Y - col(2)).abs() <= col(4));
  const auto ellipse = ((X - col(1)) / col(3)).pow(2) + ((Y - col(2)) / col(4)).pow(2) <= 1;
  // Distance to the segment from (cx, cy) to (ex, ey) below the brush radius.
  const auto dx = col(3) - col(1), dy = col(4) - col(2);
  const auto len2 = (dx * dx + dy * dy).clamp_min(1e-6);
  const auto along = (((X - col(1)) * dx + (Y - col(2)) * dy) / len2).clamp(0, 1);
  const auto stroke = (X - col(1) - along * dx).pow(2) + (Y - col(2) - along * dy).pow(2) <= col(5).pow(2);
  // The emoji's own pixels (farther than 0.05 from the background), dilated 2..10 px.
  auto table = at::empty({n}, at::kLong);
  for (int64_t i = 0; i < n; ++i) table.data_ptr<int64_t>()[i] = specs[static_cast<std::size_t>(i)].colour;
  const auto bg = colours_.to(images.device()).index_select(0, table.to(images.device())).view({n, 3, 1, 1});
  const auto fg = (images - bg).abs().amax(1, /*keepdim=*/true).gt(0.05).to(images.scalar_type());
  const int64_t grow = 2 + static_cast<int64_t>(rng() % 9);
  const auto emoji = at::max_pool2d(fg, {2 * grow + 1, 2 * grow + 1}, {1, 1}, {grow, grow}).squeeze(1).gt(0.5);
  auto mask = at::where(kind.eq(0), emoji,
                        at::where(kind.eq(1), box, at::where(kind.eq(2), ellipse, at::where(kind.eq(3), stroke, kind.eq(4)))));
  return mask.unsqueeze(1).to(images.scalar_type());
}

std::string SceneComposer::sample_caption(const SceneSpec& spec, std::mt19937_64& rng) const {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const auto& name = atlas_.sprites()[static_cast<std::size_t>(spec.emoji)].name;
  if (u(rng) < options_.name_only) return caption(name, spec, {false, false, false});
  CaptionParts parts{u(rng) < options_.keep_phrase, u(rng) < options_.keep_phrase, u(rng) < options_.keep_phrase};
  return caption(name, spec, parts);
}

std::string SceneComposer::full_caption(const SceneSpec& spec) const {
  return caption(atlas_.sprites()[static_cast<std::size_t>(spec.emoji)].name, spec);
}

int measured_background(const at::Tensor& image, at::Tensor* colour) {
  const int64_t s = image.size(1), r = std::min<int64_t>(4, s / 4);
  const auto ring = at::cat({image.narrow(1, 0, r).reshape({3, -1}), image.narrow(1, s - r, r).reshape({3, -1}),
                             image.narrow(2, 0, r).reshape({3, -1}), image.narrow(2, s - r, r).reshape({3, -1})},
                            1);
  const auto median = std::get<0>(ring.to(at::kFloat).median(1)).contiguous();
  const float* m = median.data_ptr<float>();
  int best = 0;
  double best_d = 1e9;
  const auto& named = background_colours();
  for (std::size_t i = 0; i < named.size(); ++i) {
    double d = 0;
    for (std::size_t c = 0; c < 3; ++c) {
      const double v = m[c] - named[i].rgb[c] / 255.0;
      d += v * v;
    }
    if (d < best_d) best_d = d, best = static_cast<int>(i);
  }
  if (colour) *colour = median;
  return best;
}

std::optional<std::pair<double, double>> foreground_centre(const at::Tensor& image, const at::Tensor& background) {
  const auto mask = (image.to(at::kFloat) - background.to(at::kFloat).view({3, 1, 1})).pow(2).sum(0).sqrt() > 0.2;
  const int64_t s = image.size(1);
  const double count = mask.sum().item<double>();
  if (count < 0.01 * static_cast<double>(s * image.size(2))) return std::nullopt;
  const auto m = mask.to(at::kFloat);
  const auto xs = at::arange(image.size(2), at::kFloat).div(static_cast<double>(std::max<int64_t>(image.size(2) - 1, 1)));
  const auto ys = at::arange(s, at::kFloat).div(static_cast<double>(std::max<int64_t>(s - 1, 1)));
  return std::make_pair((m * xs.view({1, -1})).sum().item<double>() / count,
                        (m * ys.view({-1, 1})).sum().item<double>() / count);
}

int measured_position(const SceneComposer& composer, const SceneSpec& spec, const at::Tensor& image) {
  at::Tensor background;
  measured_background(image, &background);
  const auto centre = foreground_centre(image, background);
  if (!centre) return -1;
  int best = -1;
  double best_d = 1e9;
  for (int p = 0; p < static_cast<int>(position_names().size()); ++p) {
    if (!valid_placement(spec.scale, p)) continue;
    const auto ref = composer.render({{spec.emoji, spec.colour, spec.scale, p}}, nullptr).squeeze(0).cpu();
    at::Tensor ref_background;
    measured_background(ref, &ref_background);
    const auto ref_centre = foreground_centre(ref, ref_background);
    if (!ref_centre) continue;
    const double dx = ref_centre->first - centre->first, dy = ref_centre->second - centre->second;
    if (dx * dx + dy * dy < best_d) best_d = dx * dx + dy * dy, best = p;
  }
  return best;
}

}  // namespace diffract::training
