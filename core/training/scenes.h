#pragma once
#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace diffract::training {

// One emoji of the atlas diffract-dataset writes.
struct SpriteInfo {
  std::string codepoints;  // "1F34E", space separated for sequences
  std::string name;        // CLDR short name from emoji-test.txt, e.g. "red apple", in ASCII
  std::string group, subgroup;
};

// The sprite atlas: atlas.json (sprite_size, columns, sheets) + index.tsv (id, codepoints,
// name, group, subgroup) + RGBA sheet PNGs, sprite i at row-major cell i of the sheets.
class SpriteAtlas {
 public:
  // `limit` > 0 keeps the first `limit` sprites (tests, quick runs).
  static SpriteAtlas load(const std::filesystem::path& dir, int64_t limit = 0);
  // An atlas from pixels [N, 4, S, S] uint8 (straight alpha) and their descriptions (tests).
  static SpriteAtlas from_pixels(at::Tensor pixels, std::vector<SpriteInfo> sprites);

  int64_t size() const { return static_cast<int64_t>(sprites_.size()); }
  int64_t sprite_size() const { return pixels_.size(2); }
  const std::vector<SpriteInfo>& sprites() const { return sprites_; }
  const at::Tensor& pixels() const { return pixels_; }
  int64_t find(const std::string& name) const;  // -1 when absent
  const std::filesystem::path& source() const { return source_; }

 private:
  std::vector<SpriteInfo> sprites_;
  at::Tensor pixels_;
  std::filesystem::path source_;
};

// The settings a caption can describe.
struct NamedColour {
  std::string name;
  std::array<std::uint8_t, 3> rgb;
};
const std::vector<NamedColour>& background_colours();
const std::vector<std::string>& scale_names();     // small, medium, large
const std::vector<std::string>& position_names();  // centre, top left, top right, bottom left, bottom right
// Sprite side in pixels for a scale on a `image_size` canvas.
int64_t scale_pixels(int scale, int64_t image_size);
// Large sprites fill the canvas, so they only appear centred.
bool valid_placement(int scale, int position);

// One scene: an emoji at a scale and position on a background colour (indices into the tables).
struct SceneSpec {
  int64_t emoji = 0;
  int colour = 0, scale = 0, position = 0;
  auto key() const { return std::make_tuple(emoji, colour, scale, position); }
  bool operator<(const SceneSpec& o) const { return key() < o.key(); }
  bool operator==(const SceneSpec& o) const { return key() == o.key(); }
};

// Which setting phrases a caption spells out; the name alone when none.
struct CaptionParts {
  bool scale = true, position = true, colour = true;
};
// "a small red apple in the top left on a light blue background", "red apple", ...
std::string caption(const std::string& name, const SceneSpec& spec, CaptionParts parts = {});

// Combinations never sampled in training, kept for evaluation. File format: TSV with a header
// line "name<TAB>colour<TAB>scale<TAB>position", one combination a line, by names.
class HoldOut {
 public:
  // `count` distinct valid combinations of distinct emoji, from a fixed seed.
  static HoldOut make(const SpriteAtlas& atlas, int count, std::uint64_t seed);
  // Names that the atlas lacks are an error naming the file and line.
  static HoldOut load(const std::filesystem::path& file, const SpriteAtlas& atlas);
  void save(const std::filesystem::path& file, const SpriteAtlas& atlas) const;
  bool contains(const SceneSpec& s) const { return set_.count(s) > 0; }
  const std::vector<SceneSpec>& specs() const { return specs_; }

 private:
  void add(const SceneSpec& s);
  std::vector<SceneSpec> specs_;
  std::set<SceneSpec> set_;
};

struct SceneOptions {
  int64_t image_size = 128;
  int64_t jitter = 4;           // random shift of each placement in pixels (0: exact)
  double name_only = 0.1;       // probability of a caption with the name alone
  double keep_phrase = 0.85;    // probability of each setting phrase otherwise
  // "" draws the emoji; "outline" draws only its lines (silhouette and colour edges) in ink
  // that stands out from the background: the style the shipped LoRA adds.
  std::string style;
};
// The styles SceneOptions::style takes.
const std::vector<std::string>& scene_styles();
// A premultiplied sprite [N, 4, s, s] as the outline style's line mask [N, 1, s, s] in [0, 1].
at::Tensor outline_lines(const at::Tensor& premultiplied);

// Composes scenes on a device: sprites pre-resized per scale (premultiplied, antialiased),
// alpha-composited onto the background colour.
class SceneComposer {
 public:
  SceneComposer(const SpriteAtlas& atlas, HoldOut holdout, SceneOptions options, c10::Device device);

  // Uniform over emoji, colours and valid (scale, position) pairs, never a held-out combination.
  std::vector<SceneSpec> sample(int64_t n, std::mt19937_64& rng) const;
  // Every combination training may see (all but the held-out ones), in a fixed order.
  std::vector<SceneSpec> all() const;
  // Images [B, 3, S, S] float in [0, 1] on the device; `rng` drives the jitter (none when null).
  at::Tensor render(const std::vector<SceneSpec>& specs, std::mt19937_64* rng) const;
  // Where spec's sprite lies without jitter: x, y, side (pixels).
  std::array<int64_t, 3> sprite_box(const SceneSpec& spec) const;
  // Inpainting masks [B, 1, S, S] (1 = repaint) on the device for rendered `images` of `specs`,
  // of the kinds a user paints: over the emoji (its pixels, dilated), a box, an ellipse, a brush
  // stroke, or everything.
  at::Tensor inpainting_masks(const at::Tensor& images, const std::vector<SceneSpec>& specs, std::mt19937_64& rng) const;
  // A caption with randomly kept phrases, as training sees them.
  std::string sample_caption(const SceneSpec& spec, std::mt19937_64& rng) const;
  std::string full_caption(const SceneSpec& spec) const;

  const SpriteAtlas& atlas() const { return atlas_; }
  const HoldOut& holdout() const { return holdout_; }
  const SceneOptions& options() const { return options_; }

 private:
  const SpriteAtlas& atlas_;
  HoldOut holdout_;
  SceneOptions options_;
  c10::Device device_;
  std::vector<at::Tensor> scaled_;  // per scale [N, 4, s, s] float, premultiplied; outline: [N, 1, s, s] lines
  at::Tensor colours_;              // [C, 3] float in [0, 1]
  at::Tensor inks_;                 // [C, 3]: the outline style's ink on each background
  std::vector<std::pair<int, int>> placements_;  // valid (scale, position)
};

// What a picture [3, S, S] in [0, 1] shows of a scene's setting, measured from its pixels (the
// evaluation's background and position checks; exact on rendered scenes, test_training).
// The named background colour nearest to the median of the picture's outer 4-pixel ring per
// channel (sprites sit centred or in a corner, never over most of the ring); `colour` [3] gets
// that median when given.
int measured_background(const at::Tensor& image, at::Tensor* colour = nullptr);
// The mean position (x, y in [0, 1]) of the pixels farther than 0.2 (RGB distance) from
// `background` [3]; none when under 1 % of the pixels are.
std::optional<std::pair<double, double>> foreground_centre(const at::Tensor& image, const at::Tensor& background);
// The valid position for spec.scale whose rendering of spec.emoji (on spec.colour, unjittered)
// centres its foreground nearest to the picture's foreground centre; -1 when the picture shows
// no foreground.
int measured_position(const SceneComposer& composer, const SceneSpec& spec, const at::Tensor& image);

}  // namespace diffract::training
