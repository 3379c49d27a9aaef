#include "core/io/image.h"

#include <png.h>
#ifdef DIFFRACT_HAS_JPEG
#include <csetjmp>
#include <jpeglib.h>
#endif

#include <algorithm>
#include <cstdio>
#include <memory>

#include "core/io/read_file.h"
#include "core/util/error.h"

namespace diffract::io {

namespace {

struct File {
  std::FILE* f;
  ~File() {
    if (f) std::fclose(f);
  }
};

// What a read's png_set_user_limits breach leaves in the error text (libpng warns, then fails
// with "Invalid IHDR data").
constexpr const char* kOverLimit = "over the size limit";

[[noreturn]] void png_fail(png_structp png, png_const_charp message) {
  auto* what = static_cast<std::string*>(png_get_error_ptr(png));
  if (*what != kOverLimit) *what = message;
  png_longjmp(png, 1);
}

void png_warn(png_structp png, png_const_charp message) {
  if (std::string(message).find("exceeds user limit") != std::string::npos)
    *static_cast<std::string*>(png_get_error_ptr(png)) = kOverLimit;
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

// Reads into `pixels` with 3 (alpha dropped) or 4 (alpha added when absent) channels; `depth`
// and `alpha` (when given) get the file's bit depth and whether it has alpha or transparency.
void read_png_pixels(const std::filesystem::path& path, int channels, int& width, int& height,
                     std::vector<std::uint8_t>& pixels, PngText* text, int* depth = nullptr, bool* alpha = nullptr) {
  require_regular_file(path);
  File file{std::fopen(path.c_str(), "rb")};
  if (!file.f) throw Error(path.string() + ": cannot open");
  unsigned char sig[8] = {};
  if (std::fread(sig, 1, 8, file.f) != 8 || png_sig_cmp(sig, 0, 8) != 0) throw Error(path.string() + ": not a PNG file");
  std::string error;
  // libpng reports errors by longjmp back to the setjmp below, past any destructor: objects
  // that own memory are made before it (found by tests/fuzz/fuzz_image: a leak per damaged file).
  std::vector<png_bytep> rows;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &error, png_fail, png_warn);
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    if (error == kOverLimit)
      throw Error(path.string() + ": the image is larger than " + std::to_string(kMaxImageSide) + " pixels a side");
    throw Error(path.string() + ": corrupt PNG: " + error);
  }
  png_init_io(png, file.f);
  png_set_sig_bytes(png, 8);
  png_set_user_limits(png, kMaxImageSide, kMaxImageSide);
  png_read_info(png, info);
  if (static_cast<long long>(png_get_image_width(png, info)) * png_get_image_height(png, info) > kMaxImagePixels) {
    png_destroy_read_struct(&png, &info, nullptr);
    throw Error(path.string() + ": the image has more than " + std::to_string(kMaxImagePixels / (1024 * 1024)) +
                " megapixels");
  }
  if (depth) *depth = png_get_bit_depth(png, info);
  if (alpha)
    *alpha = (png_get_color_type(png, info) & PNG_COLOR_MASK_ALPHA) != 0 || png_get_valid(png, info, PNG_INFO_tRNS) != 0;
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
  rows.assign(static_cast<std::size_t>(height), nullptr);
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

namespace {

#ifdef DIFFRACT_HAS_JPEG
struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = {};
};

[[noreturn]] void jpeg_fail(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->message);
  std::longjmp(e->jump, 1);
}

DecodedImage read_jpeg(const std::filesystem::path& path) {
  File file{std::fopen(path.c_str(), "rb")};
  if (!file.f) throw Error(path.string() + ": cannot open");
  DecodedImage out;
  out.format = "jpeg";
  jpeg_decompress_struct cinfo{};
  JpegError err;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_fail;
  err.mgr.output_message = [](j_common_ptr) {};  // warnings are counted (num_warnings), not printed
  std::vector<std::uint8_t> row;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    throw Error(path.string() + ": corrupt JPEG: " + err.message);
  }
  jpeg_create_decompress(&cinfo);
  jpeg_stdio_src(&cinfo, file.f);
  jpeg_read_header(&cinfo, TRUE);
  if (cinfo.image_width > static_cast<unsigned>(kMaxImageSide) || cinfo.image_height > static_cast<unsigned>(kMaxImageSide) ||
      static_cast<long long>(cinfo.image_width) * cinfo.image_height > kMaxImagePixels) {
    jpeg_destroy_decompress(&cinfo);
    throw Error(path.string() + ": the image is " + std::to_string(cinfo.image_width) + "x" +
                std::to_string(cinfo.image_height) + ", more than " + std::to_string(kMaxImageSide) +
                " pixels a side or " + std::to_string(kMaxImagePixels / (1024 * 1024)) + " megapixels");
  }
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  const bool grey = cinfo.jpeg_color_space == JCS_GRAYSCALE;
  cinfo.out_color_space = cmyk ? JCS_CMYK : grey ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_start_decompress(&cinfo);
  const int w = static_cast<int>(cinfo.output_width), h = static_cast<int>(cinfo.output_height);
  const int n = cinfo.output_components;
  out.image = Image{w, h, std::vector<std::uint8_t>(static_cast<std::size_t>(w) * h * 3)};
  row.resize(static_cast<std::size_t>(w) * n);
  // Photoshop writes Adobe CMYK inverted (255 = no ink); without its marker the values are ink.
  const bool inverted = cinfo.saw_Adobe_marker;
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW r = row.data();
    const int y = static_cast<int>(cinfo.output_scanline);
    jpeg_read_scanlines(&cinfo, &r, 1);
    std::uint8_t* dst = &out.image.rgb[static_cast<std::size_t>(y) * w * 3];
    for (int x = 0; x < w; ++x) {
      const std::uint8_t* s = &row[static_cast<std::size_t>(x) * n];
      if (cmyk) {
        const int k = inverted ? s[3] : 255 - s[3];
        for (int c = 0; c < 3; ++c) dst[x * 3 + c] = static_cast<std::uint8_t>(((inverted ? s[c] : 255 - s[c]) * k + 127) / 255);
      } else if (grey) {
        dst[x * 3] = dst[x * 3 + 1] = dst[x * 3 + 2] = s[0];
      } else {
        std::copy_n(s, 3, dst + x * 3);
      }
    }
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  if (cmyk) out.notes.push_back(path.filename().string() + ": a CMYK JPEG, converted to RGB without its colour profile");
  if (err.mgr.num_warnings > 0)
    out.notes.push_back(path.filename().string() + ": the JPEG is damaged (" + std::to_string(err.mgr.num_warnings) +
                        " problems in its data); what could be decoded is used");
  return out;
}
#endif

}  // namespace

DecodedImage read_image(const std::filesystem::path& path) {
  // read_file_head refuses a FIFO or a device at once (fopen() would block on them).
  const std::string head = read_file_head(path, 8);
  if (head.empty()) throw Error(path.string() + ": the file is empty");
  unsigned char sig[8] = {};
  std::copy(head.begin(), head.end(), sig);
  if (png_sig_cmp(sig, 0, 8) == 0) {
    DecodedImage out;
    out.format = "png";
    int depth = 8;
    bool alpha = false;
    ImageRGBA rgba;
    read_png_pixels(path, 4, rgba.width, rgba.height, rgba.rgba, nullptr, &depth, &alpha);
    const std::size_t n = static_cast<std::size_t>(rgba.width) * rgba.height;
    out.image = Image{rgba.width, rgba.height, std::vector<std::uint8_t>(n * 3)};
    if (alpha) out.alpha.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      std::copy_n(&rgba.rgba[i * 4], 3, &out.image.rgb[i * 3]);
      if (alpha) out.alpha[i] = rgba.rgba[i * 4 + 3];
    }
    if (std::all_of(out.alpha.begin(), out.alpha.end(), [](std::uint8_t a) { return a == 255; })) out.alpha.clear();
    if (depth == 16) out.notes.push_back(path.filename().string() + ": a 16-bit PNG, reduced to 8 bits a channel");
    return out;
  }
  if (sig[0] == 0xFF && sig[1] == 0xD8 && sig[2] == 0xFF) {
#ifdef DIFFRACT_HAS_JPEG
    return read_jpeg(path);
#else
    throw Error(path.string() + ": a JPEG, and this build reads PNG only (built without libjpeg): convert it to PNG");
#endif
  }
  throw Error(path.string() + ": not a PNG or JPEG image");
}

}  // namespace diffract::io
