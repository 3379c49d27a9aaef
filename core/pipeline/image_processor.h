#pragma once
// An image-conditioned job's pixels as diffusers' VaeImageProcessor prepares them: Pillow's
// Lanczos resize to the job's size, [0, 255] -> [-1, 1], masks as grey levels binarised at 50 %;
// and what follows the decode (the original's unmasked pixels pasted back, the crop of "inpaint
// at full resolution" put back in place).
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/io/image.h"
#include "core/job/request.h"

namespace diffract::pipeline {

// Pillow's Image.resize((width, height), Image.LANCZOS) of an 8-bit RGB image, bit for bit: its
// two passes (horizontal first) with 22-bit fixed-point weights, each rounded to 8 bits.
io::Image resize_lanczos(const io::Image& image, int width, int height);
// The same from the source rectangle [x0, x1) x [y0, y1) (Pillow's `box`; an empty side stretches
// the edge rows or columns as Pillow's filter weighs them).
io::Image resize_lanczos(const io::Image& image, int width, int height, double x0, double y0, double x1, double y1);
// diffusers' resize_mode "fill": the aspect kept, the rest filled from the edges; and "crop":
// the aspect kept, the excess cut, centred (each Pillow's Lanczos underneath).
io::Image resize_fill(const io::Image& image, int width, int height);
io::Image resize_crop(const io::Image& image, int width, int height);
// `src` into `dst` with its top-left at (x, y), clipped.
void paste(io::Image& dst, const io::Image& src, int x, int y);
// Pillow's convert("L"): ITU-R 601 luma, (19595 R + 38470 G + 7471 B + 2^15) >> 16.
std::vector<std::uint8_t> to_grey(const io::Image& image);
// A Gaussian blur of standard deviation `radius` pixels (edges repeated), every channel.
io::Image gaussian_blur(const io::Image& image, double radius);

// [1, 3, H, W] float32 in [-1, 1]: x / 255 * 2 - 1, as diffusers computes it.
at::Tensor image_tensor(const io::Image& image);
// [1, 1, H, W] float32: the grey level / 255, binarised (>= 0.5 -> 1).
at::Tensor mask_tensor(const io::Image& mask);

// A rectangle of pixels, x2 and y2 exclusive.
struct Box {
  int x1 = 0, y1 = 0, x2 = 0, y2 = 0;
  int width() const { return x2 - x1; }
  int height() const { return y2 - y1; }
};
// diffusers' VaeImageProcessor.get_crop_region: the box around the mask's non-zero pixels, padded
// by `pad` and grown (within the image) to the aspect ratio width : height.
Box mask_crop_region(const io::Image& mask, int width, int height, int pad);
io::Image crop(const io::Image& image, const Box& box);

// The outpainting canvas: `in`'s image grown by its outpaint_* margins, the new area filled, and
// the mask (white over the new area and outpaint_overlap pixels into the old; any mask given as
// well is kept) in place of in.image / in.mask. Throws for negative margins or an unknown fill.
void extend_canvas(job::ImageInputs& in);

// An image-conditioned job's inputs at the job's size, made once before its work.
struct PreparedInputs {
  io::Image image;        // the init image as the job runs on it (cropped and resized)
  at::Tensor pixels;      // [1, 3, H, W] in [-1, 1]
  at::Tensor mask;        // [1, 1, H, W] 0 / 1 (1: repaint); undefined without a mask
  io::Image original;     // the init image as given (for paste-back and the full-resolution crop)
  io::Image soft_mask;    // the (blurred) mask at the original's size, for the crop and its paste-back
  io::Image job_mask;     // the (blurred) mask at the job's size, not binarised, for paste-back
  bool cropped = false;   // inpaint at full resolution: `crop_box` of the original was generated
  Box crop_box;
  std::vector<std::string> notes;  // conversions the user should hear of ("mask resized ...")
};
// Checks and prepares `in` for a width x height job: the mask resized to the image's size when it
// differs (with a note), blurred, its crop region taken; throws diffract::Error for a mask with
// nothing to repaint.
PreparedInputs prepare_inputs(const job::ImageInputs& in, int width, int height);
// The job's decoded images put back: into the crop box (resized back) of the original when the
// job was cropped, then the original's unmasked pixels over them (feathered by the blurred mask)
// when `paste_back`; unchanged otherwise.
std::vector<io::Image> finish_images(const PreparedInputs& prepared, std::vector<io::Image> images, bool paste_back);

}  // namespace diffract::pipeline
