#pragma once
// The job API the GUI and the CLI drive. No torch headers: widely included.
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/io/image.h"

namespace diffract::engine {

struct GenerationRequest {
  static constexpr int kPreviewAuto = -1;  // preview_max_side: half the image's side, at most 512
  std::string model;             // diffusers folder or single-file checkpoint
  std::string model_config;      // single files: optional diffusers folder describing the components
  std::string prompt;
  std::string negative_prompt;
  int width = 0;                 // 0: the model's native size
  int height = 0;
  int steps = 30;
  double cfg = 7.0;              // <= 1 disables classifier-free guidance
  std::uint64_t seed = 0;
  std::string sampler;           // "euler", "dpmpp-2m", ...; empty: the model's own where supported
  std::string device = "cpu";    // "cpu" or "cuda:N"
  std::string taesd;             // preview decoder (TAESD folder or .pth files); empty: latent approximation
  int preview_every = 1;         // 0: no previews
  int preview_max_side = kPreviewAuto;  // TAESD previews of larger images decode from latents area-averaged
                                 // down to this many pixels a side (0: full size; auto: preview_side())
  int batch = 1;
  std::string strategy;          // multi-device strategy (core/parallel): "" or "single" runs the plain loop;
                                 // cfg-parallel, hybrid-cfg, driffusion, driffusion-aggressive, data-parallel, step-skip,
                                 // pipefusion (SD3 only)
  int devices = 1;               // devices (or drafts per round, or the skip factor) the strategy uses
  int patches = 0;               // pipefusion (SD3): latent row patches, at least `devices`; 0: one per device
  bool drop_t5 = false;          // SD3: run without the T5 encoder (its part of the prompt embedding zeros)

  // The previews' largest side in pixels (0: full size). kPreviewAuto, the default, takes
  // half the image's longer side, at most 512: SDXL 1024² previews at 512, SD 1.5 512² at 256,
  // where a full-size TAESD decode every step cost its 7 ms H200 step 7.4 % (docs/benchmarks.md).
  int preview_side() const {
    if (preview_max_side != kPreviewAuto) return preview_max_side;
    const int half = (width > height ? width : height) / 2;
    return half < 512 ? half : 512;
  }
};

struct StageTimings {
  double load_ms = 0;            // model load (0 when it was already loaded)
  double tokenize_ms = 0;
  double text_encode_ms = 0;
  std::vector<double> step_ms;   // each denoising step
  std::vector<double> preview_ms;  // each preview decode (device time on its own stream)
  int previews_dropped = 0;      // skipped because the previous preview was still decoding
  double vae_decode_ms = 0;
  double total_ms = 0;
};

struct StepEvent {
  int index = 0;                 // 0-based
  int total = 0;
  double timestep = 0;
  double step_ms = 0;
};

struct PreviewEvent {
  int index = 0;                 // the step it shows
  io::Image image;               // first image of the batch, at reduced or full size
  double decode_ms = 0;
};

struct GenerationResult {
  std::vector<io::Image> images;
  StageTimings timings;
  GenerationRequest request;     // as run: size, sampler and seed resolved
  std::string family;            // "sd1", "sd2", "sdxl"
  std::string a1111_parameters;  // the A1111 "parameters" text
  std::string metadata_json;     // the whole job and its timings
  std::vector<float> latents;    // the final latents (float32), for comparing runs
  std::vector<std::int64_t> latents_shape;
};

// Callbacks run on the generating thread; keep them short (queue to the GUI thread).
// Exactly one of on_done / on_error / on_cancelled ends every submitted job.
struct JobObserver {
  std::function<void(const std::string& stage, double ms)> on_stage;
  std::function<void(const StepEvent&)> on_step;
  std::function<void(const PreviewEvent&)> on_preview;
  std::function<void(const struct GenerationResult&)> on_done;
  std::function<void(const std::string& message)> on_error;
  std::function<void()> on_cancelled;
};

class CancelToken {
 public:
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

 private:
  std::atomic<bool> cancelled_{false};
};

// Thrown when a job stops because its token was cancelled; the engine stays usable.
struct Cancelled {};

}  // namespace diffract::engine
