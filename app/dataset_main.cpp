// diffract-dataset: renders every fully-qualified emoji of emoji-test.txt with the Noto Color
// Emoji font into an RGBA sprite atlas (sheets of sprites, glyph fitted and centred) plus its
// index (id, codepoints, name, group, subgroup): the training data of the embedded model.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <QFontDatabase>
#include <QGuiApplication>
#include <QImage>
#include <QPainter>
#include <QRawFont>
#include <QTextLayout>
#include <nlohmann/json.hpp>

namespace {

struct Entry {
  std::string codepoints, text, name, group, subgroup;
};

struct Options {
  std::string emoji_test = "/usr/share/unicode/emoji/emoji-test.txt";
  std::string font = "Noto Color Emoji";
  std::string out;
  int size = 128;
  int columns = 32;
  bool skin_tones = false;
  int limit = 0;
  std::vector<std::string> only;
};

std::string trim(const std::string& s) {
  const auto a = s.find_first_not_of(" \t\r");
  const auto b = s.find_last_not_of(" \t\r");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

std::string utf8(char32_t cp) {
  return QString::fromUcs4(&cp, 1).toStdString();
}

// emoji-test.txt lines: "1F34E ; fully-qualified # 🍎 E0.6 red apple", under "# group:" and
// "# subgroup:" headings.
std::vector<Entry> parse_emoji_test(const Options& o, std::string& version) {
  std::ifstream in(o.emoji_test);
  if (!in) throw std::runtime_error(o.emoji_test + ": cannot open (install unicode-data)");
  std::vector<Entry> out;
  std::string line, group, subgroup;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.rfind("# group:", 0) == 0) group = trim(line.substr(8));
    else if (line.rfind("# subgroup:", 0) == 0) subgroup = trim(line.substr(11));
    else if (line.rfind("# Version:", 0) == 0) version = trim(line.substr(10));
    if (line.empty() || line[0] == '#') continue;
    const auto semi = line.find(';'), hash = line.find('#');
    if (semi == std::string::npos || hash == std::string::npos || hash < semi)
      throw std::runtime_error(o.emoji_test + ":" + std::to_string(line_no) + ": not 'codepoints ; status # emoji E<version> name'");
    if (trim(line.substr(semi + 1, hash - semi - 1)) != "fully-qualified") continue;
    Entry e;
    e.codepoints = trim(line.substr(0, semi));
    std::istringstream cps(e.codepoints);
    std::string cp;
    while (cps >> cp) e.text += utf8(static_cast<char32_t>(std::stoul(cp, nullptr, 16)));
    // After '#': the emoji, "E<version>", then the name.
    const std::string rest = line.substr(hash + 1);
    const auto epos = rest.find(" E");
    const auto name_start = epos == std::string::npos ? std::string::npos : rest.find(' ', epos + 2);
    if (name_start == std::string::npos)
      throw std::runtime_error(o.emoji_test + ":" + std::to_string(line_no) + ": no name after the emoji version");
    e.name = trim(rest.substr(name_start));
    e.group = group;
    e.subgroup = subgroup;
    if (!o.skin_tones && e.name.find("skin tone") != std::string::npos) continue;
    if (!o.only.empty() && std::find(o.only.begin(), o.only.end(), e.name) == o.only.end()) continue;
    out.push_back(std::move(e));
  }
  return out;
}

// The font draws the sequence as one glyph of its own (no fallback font, no unjoined parts).
bool single_glyph(const QString& text, const QFont& font, const QString& family) {
  QTextLayout layout(text, font);
  layout.beginLayout();
  layout.createLine();
  layout.endLayout();
  int glyphs = 0;
  for (const auto& run : layout.glyphRuns()) {
    if (run.rawFont().familyName() != family) return false;
    for (auto g : run.glyphIndexes())
      if (g != 0) ++glyphs;
      else return false;
  }
  return glyphs == 1;
}

// The glyph rendered large, cropped to its alpha bounds, fitted into size x size with a margin;
// nullopt when nothing was drawn.
std::optional<QImage> render_sprite(const QString& text, const QFont& font, int size) {
  const int canvas = size * 2;
  QImage big(canvas, canvas, QImage::Format_ARGB32_Premultiplied);
  big.fill(Qt::transparent);
  {
    QPainter p(&big);
    p.setRenderHint(QPainter::Antialiasing);
    p.setRenderHint(QPainter::SmoothPixmapTransform);
    p.setFont(font);
    p.drawText(QRect(0, 0, canvas, canvas), Qt::AlignCenter, text);
  }
  int x0 = canvas, y0 = canvas, x1 = -1, y1 = -1;
  for (int y = 0; y < canvas; ++y) {
    const auto* row = reinterpret_cast<const QRgb*>(big.constScanLine(y));
    for (int x = 0; x < canvas; ++x)
      if (qAlpha(row[x]) > 8) {
        x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
      }
  }
  if (x1 < 0) return std::nullopt;
  const int margin = size / 32;
  QImage glyph = big.copy(x0, y0, x1 - x0 + 1, y1 - y0 + 1)
                     .scaled(size - 2 * margin, size - 2 * margin, Qt::KeepAspectRatio, Qt::SmoothTransformation);
  QImage sprite(size, size, QImage::Format_ARGB32_Premultiplied);
  sprite.fill(Qt::transparent);
  QPainter p(&sprite);
  p.drawImage((size - glyph.width()) / 2, (size - glyph.height()) / 2, glyph);
  return sprite;
}

int run(const Options& o) {
  if (o.size < 16 || o.columns < 1) throw std::runtime_error("--size must be at least 16 and --columns at least 1");
  const auto families = QFontDatabase::families();
  if (!families.contains(QString::fromStdString(o.font)))
    throw std::runtime_error("font '" + o.font + "' is not installed (Debian: fonts-noto-color-emoji)");
  std::string version;
  const auto entries = parse_emoji_test(o, version);
  if (entries.empty()) throw std::runtime_error(o.emoji_test + ": no fully-qualified emoji selected");
  QFont font(QString::fromStdString(o.font));
  font.setPixelSize(o.size * 5 / 4);
  font.setStyleStrategy(QFont::NoFontMerging);
  const QString family = QFontInfo(font).family();

  std::filesystem::create_directories(o.out);
  const int per_sheet = o.columns * o.columns;
  std::vector<std::string> sheets;
  QImage sheet;
  std::ofstream index(std::filesystem::path(o.out) / "index.tsv");
  if (!index) throw std::runtime_error(o.out + ": cannot write index.tsv");
  index << "id\tcodepoints\tname\tgroup\tsubgroup\n";
  int count = 0, skipped = 0;
  auto flush = [&]() {
    if (sheet.isNull()) return;
    char name[32];
    std::snprintf(name, sizeof name, "sheet_%02zu.png", sheets.size());
    const auto path = (std::filesystem::path(o.out) / name).string();
    if (!sheet.save(QString::fromStdString(path), "PNG")) throw std::runtime_error(path + ": cannot write");
    sheets.emplace_back(name);
    sheet = QImage();
  };
  for (const auto& e : entries) {
    if (o.limit > 0 && count >= o.limit) break;
    const auto text = QString::fromStdString(e.text);
    std::optional<QImage> sprite;
    if (single_glyph(text, font, family)) sprite = render_sprite(text, font, o.size);
    if (!sprite) {
      ++skipped;
      std::cerr << "skipped (the font lacks it): " << e.codepoints << " " << e.name << "\n";
      continue;
    }
    const int cell = count % per_sheet;
    if (cell == 0) {
      flush();
      sheet = QImage(o.columns * o.size, o.columns * o.size, QImage::Format_ARGB32_Premultiplied);
      sheet.fill(Qt::transparent);
    }
    QPainter p(&sheet);
    p.setCompositionMode(QPainter::CompositionMode_Source);
    p.drawImage((cell % o.columns) * o.size, (cell / o.columns) * o.size, *sprite);
    p.end();
    index << count << '\t' << e.codepoints << '\t' << e.name << '\t' << e.group << '\t' << e.subgroup << '\n';
    ++count;
  }
  flush();
  if (count == 0) throw std::runtime_error("no emoji rendered: does font '" + o.font + "' have colour glyphs?");
  nlohmann::json meta = {{"version", 1},
                         {"sprite_size", o.size},
                         {"columns", o.columns},
                         {"count", count},
                         {"skipped", skipped},
                         {"sheets", sheets},
                         {"font", family.toStdString()},
                         {"emoji_test", o.emoji_test},
                         {"emoji_version", version},
                         {"skin_tones", o.skin_tones},
                         {"licences", "Noto Color Emoji: SIL Open Font License 1.1 (Debian fonts-noto-color-emoji); "
                                      "emoji names: Unicode License v3 (Debian unicode-data)"}};
  std::ofstream(std::filesystem::path(o.out) / "atlas.json") << meta.dump(2) << '\n';
  std::cout << "rendered " << count << " emoji (" << skipped << " skipped) into " << sheets.size() << " sheet(s) in "
            << o.out << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (!qEnvironmentVariableIsSet("QT_QPA_PLATFORM")) qputenv("QT_QPA_PLATFORM", "offscreen");
  QGuiApplication qt(argc, argv);
  CLI::App app{"diffract-dataset: the emoji sprite atlas the embedded model trains on"};
  Options o;
  app.add_option("--out", o.out, "atlas folder (atlas.json, index.tsv, sheet_NN.png)")->required();
  app.add_option("--emoji-test", o.emoji_test, "unicode-data's emoji-test.txt")->capture_default_str();
  app.add_option("--font", o.font, "colour emoji font family")->capture_default_str();
  app.add_option("--size", o.size, "sprite side in pixels")->capture_default_str();
  app.add_option("--columns", o.columns, "sprites per sheet side")->capture_default_str();
  app.add_flag("--skin-tones", o.skin_tones, "also the skin-tone variants (names '...: medium skin tone')");
  app.add_option("--limit", o.limit, "first N emoji only (0: all)")->capture_default_str();
  app.add_option("--only", o.only, "only these names (comma separated)")->delimiter(',');
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << "diffract-dataset: " << e.what() << "\n";
    return 1;
  }
}
