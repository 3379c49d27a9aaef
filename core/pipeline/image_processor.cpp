#include "core/pipeline/image_processor.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <ATen/ATen.h>

#include "core/io/image.h"
#include "core/util/error.h"

namespace diffract::pipeline {

namespace {

constexpr double kPi = 3.14159265358979323846;
constexpr int kPrecisionBits = 32 - 8 - 2;  // Pillow's PRECISION_BITS for 8-bit images

double sinc(double x) {
  if (x == 0.0) return 1.0;
  x *= kPi;
  return std::sin(x) / x;
}

double lanczos3(double x) { return -3.0 <= x && x < 3.0 ? sinc(x) * sinc(x / 3) : 0.0; }

// Pillow's precompute_coeffs + normalize_coeffs_8bpc for one axis: for each output index its
// first input index, its count and `ksize` fixed-point weights.
struct Weights {
  int ksize = 0;
  std::vector<int> first, count;
  std::vector<std::int32_t> k;
};

// The source range [in0, in1) of the axis (Pillow's resize box) onto out_size samples.
Weights lanczos_weights(int in_size, double in0, double in1, int out_size) {
  const double scale = (in1 - in0) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = 3.0 * filterscale;
  Weights w;
  w.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  w.first.resize(out_size);
  w.count.resize(out_size);
  w.k.assign(static_cast<size_t>(out_size) * w.ksize, 0);
  std::vector<double> k(w.ksize);
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = in0 + (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);  // C's truncation, as Pillow
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      k[x] = lanczos3((x + xmin - center + 0.5) * ss);
      ww += k[x];
    }
    for (int x = 0; x < xmax; ++x) {
      const double v = ww != 0.0 ? k[x] / ww : k[x];
      w.k[static_cast<size_t>(xx) * w.ksize + x] =
          static_cast<std::int32_t>(v < 0 ? -0.5 + v * (1 << kPrecisionBits) : 0.5 + v * (1 << kPrecisionBits));
    }
    w.first[xx] = xmin;
    w.count[xx] = xmax;
  }
  return w;
}

std::uint8_t clip8(std::int64_t v) {
  const std::int64_t s = v >> kPrecisionBits;  // arithmetic: floor, as Pillow's lookup table
  return static_cast<std::uint8_t>(std::clamp<std::int64_t>(s, 0, 255));
}

// One pass along x (horizontal) or y of an interleaved `channels` image.
std::vector<std::uint8_t> resample_axis(const std::vector<std::uint8_t>& in, int w, int h, int channels, bool along_x,
                                        int out_size, const Weights& wt) {
  const int ow = along_x ? out_size : w, oh = along_x ? h : out_size;
  std::vector<std::uint8_t> out(static_cast<size_t>(ow) * oh * channels);
  for (int y = 0; y < oh; ++y)
    for (int x = 0; x < ow; ++x) {
      const int o = along_x ? x : y;
      const std::int32_t* k = &wt.k[static_cast<size_t>(o) * wt.ksize];
      for (int c = 0; c < channels; ++c) {
        std::int64_t ss = std::int64_t(1) << (kPrecisionBits - 1);
        for (int i = 0; i < wt.count[o]; ++i) {
          const int sx = along_x ? wt.first[o] + i : x, sy = along_x ? y : wt.first[o] + i;
          ss += static_cast<std::int64_t>(in[(static_cast<size_t>(sy) * w + sx) * channels + c]) * k[i];
        }
        out[(static_cast<size_t>(y) * ow + x) * channels + c] = clip8(ss);
      }
    }
  return out;
}

void check_image(const io::Image& image, const char* what) {
  if (image.width <= 0 || image.height <= 0 ||
      image.rgb.size() != static_cast<size_t>(image.width) * image.height * 3)
    throw Error(std::string(what) + ": not an RGB image of its stated size");
}

}  // namespace

io::Image resize_lanczos(const io::Image& image, int width, int height) {
  check_image(image, "resize");
  return resize_lanczos(image, width, height, 0, 0, image.width, image.height);
}

io::Image resize_lanczos(const io::Image& image, int width, int height, double x0, double y0, double x1, double y1) {
  check_image(image, "resize");
  if (width <= 0 || height <= 0) throw Error("resize to " + std::to_string(width) + "x" + std::to_string(height));
  if (x0 < 0 || y0 < 0 || x1 > image.width || y1 > image.height || x1 < x0 || y1 < y0)
    throw Error("resize box outside the image");
  const bool along_x = width != image.width || x0 != 0 || x1 != image.width;
  const bool along_y = height != image.height || y0 != 0 || y1 != image.height;
  std::vector<std::uint8_t> px = image.rgb;
  int w = image.width;
  if (along_x) {
    px = resample_axis(px, w, image.height, 3, true, width, lanczos_weights(image.width, x0, x1, width));
    w = width;
  }
  if (along_y) px = resample_axis(px, w, image.height, 3, false, height, lanczos_weights(image.height, y0, y1, height));
  return io::Image{width, height, std::move(px)};
}

void paste(io::Image& dst, const io::Image& src, int x, int y) {
  for (int sy = 0; sy < src.height; ++sy) {
    const int dy = y + sy;
    if (dy < 0 || dy >= dst.height) continue;
    const int sx0 = std::max(0, -x), sx1 = std::min(src.width, dst.width - x);
    if (sx1 <= sx0) continue;
    std::copy_n(&src.rgb[(static_cast<size_t>(sy) * src.width + sx0) * 3], static_cast<size_t>(sx1 - sx0) * 3,
                &dst.rgb[(static_cast<size_t>(dy) * dst.width + x + sx0) * 3]);
  }
}

io::Image resize_fill(const io::Image& image, int width, int height) {
  check_image(image, "resize");
  const double ratio = static_cast<double>(width) / height, src_ratio = static_cast<double>(image.width) / image.height;
  const int src_w = ratio < src_ratio ? width : image.width * height / image.height;
  const int src_h = ratio >= src_ratio ? height : image.height * width / image.width;
  const auto resized = resize_lanczos(image, src_w, src_h);
  io::Image res{width, height, std::vector<std::uint8_t>(static_cast<size_t>(width) * height * 3, 0)};
  paste(res, resized, width / 2 - src_w / 2, height / 2 - src_h / 2);
  if (ratio < src_ratio) {
    const int fill = height / 2 - src_h / 2;
    if (fill > 0) {
      paste(res, resize_lanczos(resized, width, fill, 0, 0, width, 0), 0, 0);
      paste(res, resize_lanczos(resized, width, fill, 0, resized.height, width, resized.height), 0, fill + src_h);
    }
  } else if (ratio > src_ratio) {
    const int fill = width / 2 - src_w / 2;
    if (fill > 0) {
      paste(res, resize_lanczos(resized, fill, height, 0, 0, 0, height), 0, 0);
      paste(res, resize_lanczos(resized, fill, height, resized.width, 0, resized.width, height), fill + src_w, 0);
    }
  }
  return res;
}

io::Image resize_crop(const io::Image& image, int width, int height) {
  check_image(image, "resize");
  const double ratio = static_cast<double>(width) / height, src_ratio = static_cast<double>(image.width) / image.height;
  const int src_w = ratio > src_ratio ? width : image.width * height / image.height;
  const int src_h = ratio <= src_ratio ? height : image.height * width / image.width;
  io::Image res{width, height, std::vector<std::uint8_t>(static_cast<size_t>(width) * height * 3, 0)};
  paste(res, resize_lanczos(image, src_w, src_h), width / 2 - src_w / 2, height / 2 - src_h / 2);
  return res;
}

std::vector<std::uint8_t> to_grey(const io::Image& image) {
  check_image(image, "grey");
  std::vector<std::uint8_t> out(static_cast<size_t>(image.width) * image.height);
  for (size_t i = 0; i < out.size(); ++i) {
    const auto* p = &image.rgb[i * 3];
    out[i] = static_cast<std::uint8_t>((p[0] * 19595u + p[1] * 38470u + p[2] * 7471u + 0x8000u) >> 16);
  }
  return out;
}

io::Image gaussian_blur(const io::Image& image, double radius) {
  check_image(image, "blur");
  if (!(radius > 0)) return image;
  const int r = static_cast<int>(std::ceil(3 * radius));
  std::vector<double> k(2 * r + 1);
  double sum = 0;
  for (int i = -r; i <= r; ++i) sum += k[i + r] = std::exp(-0.5 * i * i / (radius * radius));
  for (auto& v : k) v /= sum;
  const int w = image.width, h = image.height;
  std::vector<double> tmp(image.rgb.size());
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c) {
        double s = 0;
        for (int i = -r; i <= r; ++i) s += k[i + r] * image.rgb[(static_cast<size_t>(y) * w + std::clamp(x + i, 0, w - 1)) * 3 + c];
        tmp[(static_cast<size_t>(y) * w + x) * 3 + c] = s;
      }
  io::Image out{w, h, std::vector<std::uint8_t>(image.rgb.size())};
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c) {
        double s = 0;
        for (int i = -r; i <= r; ++i) s += k[i + r] * tmp[(static_cast<size_t>(std::clamp(y + i, 0, h - 1)) * w + x) * 3 + c];
        out.rgb[(static_cast<size_t>(y) * w + x) * 3 + c] = static_cast<std::uint8_t>(std::clamp(std::lround(s), 0L, 255L));
      }
  return out;
}

at::Tensor image_tensor(const io::Image& image) {
  check_image(image, "image");
  auto u8 = at::from_blob(const_cast<std::uint8_t*>(image.rgb.data()), {1, image.height, image.width, 3}, at::kByte);
  auto x = u8.permute({0, 3, 1, 2}).to(at::kFloat).contiguous() / 255.0;
  return 2.0 * x - 1.0;
}

at::Tensor mask_tensor(const io::Image& mask) {
  auto grey = to_grey(mask);
  auto m = at::from_blob(grey.data(), {1, 1, mask.height, mask.width}, at::kByte).to(at::kFloat) / 255.0;
  return (m >= 0.5).to(at::kFloat);
}

Box mask_crop_region(const io::Image& mask, int width, int height, int pad) {
  const auto grey = to_grey(mask);
  const int w = mask.width, h = mask.height;
  int left = w, right = -1, top = h, bottom = -1;
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      if (grey[static_cast<size_t>(y) * w + x] != 0) {
        left = std::min(left, x);
        right = std::max(right, x);
        top = std::min(top, y);
        bottom = std::max(bottom, y);
      }
  if (right < 0) return Box{0, 0, w, h};
  Box b{std::max(left - pad, 0), std::max(top - pad, 0), std::min(right + 1 + pad, w), std::min(bottom + 1 + pad, h)};
  // Grown to the processing aspect about its centre, then moved back inside the image, as
  // diffusers does (desired size truncated, Python's floor division of the difference).
  const auto grow = [](int& lo, int& hi, int desired_diff, int limit) {
    const int half = desired_diff >= 0 ? desired_diff / 2 : -((-desired_diff + 1) / 2);
    lo -= half;
    hi += desired_diff - half;
    if (hi >= limit) {
      const int diff = hi - limit;
      hi -= diff;
      lo -= diff;
    }
    if (lo < 0) {
      hi -= lo;
      lo = 0;
    }
    if (hi >= limit) hi = limit;
  };
  const double ratio_crop = static_cast<double>(b.width()) / b.height(), ratio = static_cast<double>(width) / height;
  if (ratio_crop > ratio)
    grow(b.y1, b.y2, static_cast<int>(b.width() / ratio - b.height()), h);
  else
    grow(b.x1, b.x2, static_cast<int>(b.height() * ratio - b.width()), w);
  return b;
}

io::Image crop(const io::Image& image, const Box& box) {
  check_image(image, "crop");
  if (box.x1 < 0 || box.y1 < 0 || box.x2 > image.width || box.y2 > image.height || box.width() <= 0 || box.height() <= 0)
    throw Error("crop box outside the image");
  io::Image out{box.width(), box.height(), {}};
  out.rgb.reserve(static_cast<size_t>(out.width) * out.height * 3);
  for (int y = box.y1; y < box.y2; ++y) {
    const auto* row = &image.rgb[(static_cast<size_t>(y) * image.width + box.x1) * 3];
    out.rgb.insert(out.rgb.end(), row, row + static_cast<size_t>(out.width) * 3);
  }
  return out;
}

void extend_canvas(job::ImageInputs& in) {
  check_image(in.image, "the init image");
  const int l = in.outpaint_left, t = in.outpaint_top, r = in.outpaint_right, b = in.outpaint_bottom;
  if (l < 0 || t < 0 || r < 0 || b < 0) throw Error("outpaint margins must be 0 or more pixels");
  if (in.outpaint_fill != "edge" && in.outpaint_fill != "blur")
    throw Error("outpaint fill '" + in.outpaint_fill + "': expected edge or blur");
  if (in.outpaint_overlap < 0) throw Error("outpaint overlap must be 0 or more pixels");
  const int w = in.image.width, h = in.image.height, W = w + l + r, H = h + t + b;
  if (W > io::kMaxImageSide || H > io::kMaxImageSide)
    throw Error("the outpainted canvas (" + std::to_string(W) + "x" + std::to_string(H) + ") is larger than " +
                std::to_string(io::kMaxImageSide) + " pixels a side");
  io::Image canvas{W, H, std::vector<std::uint8_t>(static_cast<size_t>(W) * H * 3)};
  for (int y = 0; y < H; ++y)
    for (int x = 0; x < W; ++x) {
      const int sx = std::clamp(x - l, 0, w - 1), sy = std::clamp(y - t, 0, h - 1);
      std::copy_n(&in.image.rgb[(static_cast<size_t>(sy) * w + sx) * 3], 3, &canvas.rgb[(static_cast<size_t>(y) * W + x) * 3]);
    }
  const auto inside = [&](int x, int y, int margin) {
    return x >= l + margin && x < l + w - margin && y >= t + margin && y < t + h - margin;
  };
  if (in.outpaint_fill == "blur") {
    // The repeated edge, blurred over the new area only (a quarter of the widest margin).
    const auto blurred = gaussian_blur(canvas, std::max({l, t, r, b}) / 4.0);
    for (int y = 0; y < H; ++y)
      for (int x = 0; x < W; ++x)
        if (!inside(x, y, 0))
          std::copy_n(&blurred.rgb[(static_cast<size_t>(y) * W + x) * 3], 3, &canvas.rgb[(static_cast<size_t>(y) * W + x) * 3]);
  }
  io::Image mask{W, H, std::vector<std::uint8_t>(static_cast<size_t>(W) * H * 3, 0)};
  const auto given = in.has_mask() ? to_grey(in.mask.width == w && in.mask.height == h ? in.mask : resize_lanczos(in.mask, w, h))
                                   : std::vector<std::uint8_t>();
  // The overlap only where the old area borders a new one.
  const int ol = l > 0 ? in.outpaint_overlap : 0, ot = t > 0 ? in.outpaint_overlap : 0;
  const int orr = r > 0 ? in.outpaint_overlap : 0, ob = b > 0 ? in.outpaint_overlap : 0;
  for (int y = 0; y < H; ++y)
    for (int x = 0; x < W; ++x) {
      const bool kept = x >= l + ol && x < l + w - orr && y >= t + ot && y < t + h - ob;
      std::uint8_t v = kept ? 0 : 255;
      if (kept && !given.empty()) v = given[static_cast<size_t>(y - t) * w + (x - l)];
      std::fill_n(&mask.rgb[(static_cast<size_t>(y) * W + x) * 3], 3, v);
    }
  in.image = std::move(canvas);
  in.mask = std::move(mask);
  in.outpaint_left = in.outpaint_top = in.outpaint_right = in.outpaint_bottom = 0;
}

PreparedInputs prepare_inputs(const job::ImageInputs& in, int width, int height) {
  PreparedInputs p;
  check_image(in.image, "the init image");
  p.original = in.image;
  if (in.has_mask()) {
    check_image(in.mask, "the mask");
    // Blurred at its own size, then resized straight to the job's (diffusers resizes image and
    // mask to the job's size apart); paste-back and the crop take it at the image's size.
    const io::Image mask = in.mask_blur > 0 ? gaussian_blur(in.mask, in.mask_blur) : in.mask;
    const auto grey = to_grey(mask);
    if (std::none_of(grey.begin(), grey.end(), [](std::uint8_t v) { return v >= 128; }))
      throw Error("the mask has nothing to repaint: no pixel is at least 50 % white (white = repaint)");
    const bool same_size = mask.width == in.image.width && mask.height == in.image.height;
    if (!same_size)
      p.notes.push_back("the mask (" + std::to_string(mask.width) + "x" + std::to_string(mask.height) +
                        ") is resized to the image's " + std::to_string(in.image.width) + "x" +
                        std::to_string(in.image.height));
    p.soft_mask = same_size ? mask : resize_lanczos(mask, in.image.width, in.image.height);
    if (in.full_res_padding >= 0) {
      p.crop_box = mask_crop_region(p.soft_mask, width, height, in.full_res_padding);
      p.cropped = true;
      p.image = resize_fill(crop(in.image, p.crop_box), width, height);
      p.mask = mask_tensor(resize_fill(crop(p.soft_mask, p.crop_box), width, height));
    } else {
      p.image = resize_lanczos(in.image, width, height);
      p.job_mask = resize_lanczos(mask, width, height);
      p.mask = mask_tensor(p.job_mask);
    }
    if (!(p.mask >= 0.5).any().item<bool>())
      throw Error("the mask has nothing to repaint at the job's size (" + std::to_string(width) + "x" +
                  std::to_string(height) + "): its white area vanished in the resize; make it larger");
  } else {
    p.image = resize_lanczos(in.image, width, height);
  }
  p.pixels = image_tensor(p.image);
  return p;
}

namespace {

// `base` with `over` composited on top at opacity (255 - mask) / 255 per pixel.
io::Image composite_unmasked(const io::Image& base, const io::Image& over, const std::vector<std::uint8_t>& mask) {
  io::Image out = base;
  for (size_t i = 0; i < mask.size(); ++i) {
    const int a = 255 - mask[i];
    for (int c = 0; c < 3; ++c) {
      const size_t j = i * 3 + c;
      out.rgb[j] = static_cast<std::uint8_t>((over.rgb[j] * a + base.rgb[j] * (255 - a) + 127) / 255);
    }
  }
  return out;
}

}  // namespace

std::vector<io::Image> finish_images(const PreparedInputs& p, std::vector<io::Image> images, bool paste_back) {
  for (auto& img : images) {
    if (p.cropped) {
      io::Image full = p.original;
      paste(full, resize_crop(img, p.crop_box.width(), p.crop_box.height()), p.crop_box.x1, p.crop_box.y1);
      img = composite_unmasked(full, p.original, to_grey(p.soft_mask));
    } else if (paste_back && p.mask.defined()) {
      img = composite_unmasked(img, p.image, to_grey(p.job_mask));
    }
  }
  return images;
}

}  // namespace diffract::pipeline
