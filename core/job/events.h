#pragma once
// What a running job reports. No torch headers.
#include <functional>
#include <string>
#include <vector>

#include "core/io/image.h"

namespace diffract::job {

struct GenerationResult;

struct StageTimings {
  double load_ms = 0;            // model load (0 when it was already loaded)
  double tokenize_ms = 0;
  double text_encode_ms = 0;
  std::vector<double> step_ms;   // each denoising step
  std::vector<int> cached_steps; // the steps (indices into step_ms) a step cache served
  std::vector<double> preview_ms;  // each preview decode (device time on its own stream)
  int previews_dropped = 0;      // skipped because the previous preview was still decoding
  double vae_encode_ms = 0;      // image inputs' VAE encodes (their enqueueing on a GPU)
  double vae_decode_ms = 0;
  double total_ms = 0;
};

struct StepEvent {
  int index = 0;                 // 0-based
  int total = 0;
  double timestep = 0;
  double step_ms = 0;
  bool cached = false;           // a step cache (fbcache) reused most of the model this step
};

struct PreviewEvent {
  int index = 0;                 // the step it shows
  io::Image image;               // first image of the batch, at reduced or full size
  double decode_ms = 0;
};

// Callbacks run on the generating thread; keep them short (queue to the GUI thread).
// Exactly one of on_done / on_error / on_cancelled ends every submitted job.
struct JobObserver {
  std::function<void(const std::string& stage, double ms)> on_stage;
  std::function<void(const StepEvent&)> on_step;
  std::function<void(const PreviewEvent&)> on_preview;
  std::function<void(const GenerationResult&)> on_done;
  std::function<void(const std::string& message)> on_error;
  std::function<void()> on_cancelled;
};

}  // namespace diffract::job
