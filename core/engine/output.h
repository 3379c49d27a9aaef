#pragma once
// Where finished images go and how they are named and written, for the GUI and the CLI alike.
// No torch headers.
#include <ctime>
#include <filesystem>
#include <string>

#include "core/io/image.h"
#include "core/job/request.h"

namespace diffract::engine {

// The GUI's output folder: $DIFFRACT_OUTPUT_DIR, else `fallback` (the platform's pictures
// folder, which only the caller knows).
std::filesystem::path output_dir(const std::filesystem::path& fallback);

// Image `index` of a batch of `count` written to `out` (the CLI's --out): `out` itself for one
// image, else <stem>_<index><extension> beside it.
std::filesystem::path batch_file(const std::filesystem::path& out, int index, int count);

// The texts image `index` of a batch of `count` is saved with: the job's metadata JSON with its
// "batch_index", and its A1111 parameters with "Batch size: N, Batch pos: I" as A1111 writes
// them. A batch's images share one seed (their noise is one draw of the batch's shape, as in
// diffusers), so the position is what tells them apart. One image: the texts unchanged.
struct BatchImageText {
  std::string parameters, metadata_json;
};
BatchImageText batch_image_text(const std::string& parameters, const std::string& metadata_json, int index, int count);

// The local time `t` as yyyyMMdd-HHmmss, the start of the GUI's file names.
std::string output_stamp(std::time_t t);

// A file in `dir` that does not exist yet, so that an earlier image is never overwritten:
// <stamp>-<seed>-<index>.png, else <stamp>-<seed>-<index>-<n>.png with the first free n.
std::filesystem::path unused_output_file(const std::filesystem::path& dir, const std::string& stamp,
                                         const std::string& seed, int index);

// Writes `image` as a PNG carrying its A1111 "parameters" and Diffract "diffract" (JSON) text
// chunks. It goes to a temporary file in the same folder, renamed onto `path` once complete, so
// a failed write (a full disk, a bad image) leaves no partial PNG and any earlier file at `path`
// untouched. Throws diffract::Error naming the file.
void save_image(const std::filesystem::path& path, const io::Image& image, const std::string& parameters,
                const std::string& metadata_json);
// The same with any text chunks (a variation grid's "diffract-grid").
void save_png(const std::filesystem::path& path, const io::Image& image, const io::PngText& text);

// A job's init image and mask written beside the PNG it made, as <folder>/inputs/<stem>.input.png
// and <stem>.mask.png (the gallery lists only the folder itself), and its ControlNets' control
// images as <stem>.control<N>.png, so that restoring the PNG brings them back. Returns
// `metadata_json` with their names, relative to the PNG's folder, added to its "input" object
// (input_file, mask_file) and to each "controlnets" entry (image_file); unchanged for a job
// without images.
std::string save_inputs_beside(const std::filesystem::path& png, const job::ImageInputs& in,
                               const std::vector<job::ControlNetRef>& controlnets, const std::string& metadata_json);

}  // namespace diffract::engine
