#include "core/io/image.h"

#include <png.h>

#include <cstdio>
#include <memory>

#include "core/util/error.h"

namespace diffract::io {

namespace {

struct File {
  std::FILE* f;
  ~File() {
    if (f) std::fclose(f);
  }
};

[[noreturn]] void png_fail(png_structp png, png_const_charp message) {
  auto* what = static_cast<std::string*>(png_get_error_ptr(png));
  *what = message;
  png_longjmp(png, 1);
}

void collect_text(png_structp png, png_infop info, PngText* out) {
  if (!out) return;
  png_textp text = nullptr;
  int n = png_get_text(png, info, &text, nullptr);
  for (int i = 0; i < n; ++i) {
    const std::size_t len = text[i].compression > 0 ? text[i].itxt_length : text[i].text_length;
    out->emplace_back(text[i].key, std::string(text[i].text, len));
  }
}

}  // namespace

void write_png(const std::filesystem::path& path, const Image& image, const PngText& text) {
  if (image.width <= 0 || image.height <= 0 ||
      image.rgb.size() != static_cast<std::size_t>(image.width) * image.height * 3)
    throw Error(path.string() + ": cannot write an empty or malformed image");
  File file{std::fopen(path.c_str(), "wb")};
  if (!file.f) throw Error(path.string() + ": cannot open for writing");
  std::string error;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &error, png_fail, nullptr);
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    throw Error(path.string() + ": PNG write failed: " + error);
  }
  png_init_io(png, file.f);
  png_set_IHDR(png, info, static_cast<png_uint_32>(image.width), static_cast<png_uint_32>(image.height), 8,
               PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  std::vector<png_text> chunks(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    chunks[i] = {};
    chunks[i].compression = PNG_ITXT_COMPRESSION_NONE;
    chunks[i].key = const_cast<char*>(text[i].first.c_str());
    chunks[i].text = const_cast<char*>(text[i].second.c_str());
    chunks[i].itxt_length = text[i].second.size();
    chunks[i].lang = nullptr;
    chunks[i].lang_key = nullptr;
  }
  if (!chunks.empty()) png_set_text(png, info, chunks.data(), static_cast<int>(chunks.size()));
  png_write_info(png, info);
  for (int y = 0; y < image.height; ++y)
    png_write_row(png, const_cast<png_bytep>(image.rgb.data() + static_cast<std::size_t>(y) * image.width * 3));
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  if (std::fflush(file.f) != 0) throw Error(path.string() + ": write failed (disk full?)");
}

namespace {

// Reads into `pixels` with 3 (alpha dropped) or 4 (alpha added when absent) channels.
void read_png_pixels(const std::filesystem::path& path, int channels, int& width, int& height,
                     std::vector<std::uint8_t>& pixels, PngText* text) {
  File file{std::fopen(path.c_str(), "rb")};
  if (!file.f) throw Error(path.string() + ": cannot open");
  unsigned char sig[8] = {};
  if (std::fread(sig, 1, 8, file.f) != 8 || png_sig_cmp(sig, 0, 8) != 0) throw Error(path.string() + ": not a PNG file");
  std::string error;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &error, png_fail, nullptr);
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    throw Error(path.string() + ": corrupt PNG: " + error);
  }
  png_init_io(png, file.f);
  png_set_sig_bytes(png, 8);
  png_read_info(png, info);
  png_set_expand(png);
  png_set_strip_16(png);
  if (channels == 3)
    png_set_strip_alpha(png);
  else
    png_set_add_alpha(png, 0xff, PNG_FILLER_AFTER);
  png_set_gray_to_rgb(png);
  png_read_update_info(png, info);
  width = static_cast<int>(png_get_image_width(png, info));
  height = static_cast<int>(png_get_image_height(png, info));
  pixels.resize(static_cast<std::size_t>(width) * height * channels);
  std::vector<png_bytep> rows(static_cast<std::size_t>(height));
  for (int y = 0; y < height; ++y) rows[y] = pixels.data() + static_cast<std::size_t>(y) * width * channels;
  png_read_image(png, rows.data());
  png_read_end(png, info);
  collect_text(png, info, text);
  png_destroy_read_struct(&png, &info, nullptr);
}

}  // namespace

Image read_png(const std::filesystem::path& path, PngText* text) {
  Image image;
  read_png_pixels(path, 3, image.width, image.height, image.rgb, text);
  return image;
}

ImageRGBA read_png_rgba(const std::filesystem::path& path) {
  ImageRGBA image;
  read_png_pixels(path, 4, image.width, image.height, image.rgba, nullptr);
  return image;
}

}  // namespace diffract::io
