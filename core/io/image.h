#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace diffract::io {

// An 8-bit RGB image, rows top to bottom, no padding.
struct Image {
  int width = 0;
  int height = 0;
  std::vector<std::uint8_t> rgb;  // width * height * 3
};

// PNG text chunks: key -> UTF-8 value (written as uncompressed iTXt, read from tEXt/zTXt/iTXt).
using PngText = std::vector<std::pair<std::string, std::string>>;

void write_png(const std::filesystem::path& path, const Image& image, const PngText& text = {});
// Reads any 8/16-bit PNG as RGB8 (alpha dropped, palette and grey expanded) with its text chunks.
Image read_png(const std::filesystem::path& path, PngText* text = nullptr);

// An 8-bit RGBA image (straight, not premultiplied alpha), rows top to bottom, no padding.
struct ImageRGBA {
  int width = 0;
  int height = 0;
  std::vector<std::uint8_t> rgba;  // width * height * 4
};
// Reads any 8/16-bit PNG as RGBA8 (opaque alpha added where the file has none).
ImageRGBA read_png_rgba(const std::filesystem::path& path);

// Images larger than this many pixels a side, or in all, are refused before their pixels are read.
inline constexpr int kMaxImageSide = 16384;
inline constexpr long long kMaxImagePixels = 128LL * 1024 * 1024;

// An input image as a job takes it, with what reading it changed.
struct DecodedImage {
  Image image;                      // RGB8
  std::vector<std::uint8_t> alpha;  // width * height, when the file has an alpha channel that is not all opaque
  std::string format;               // "png", "jpeg"
  std::vector<std::string> notes;   // conversions made: "16-bit PNG reduced to 8 bits", "CMYK JPEG converted to RGB"
};
// A PNG (grey, palette, RGB, with or without alpha, 8 or 16 bits) or, when the build has libjpeg,
// a JPEG (grey, RGB, CMYK or YCCK, Adobe's inverted CMYK included), told apart by their first
// bytes. Errors name the file and what is wrong (not an image, corrupt, too large).
DecodedImage read_image(const std::filesystem::path& path);

}  // namespace diffract::io
