#pragma once
// What a job asks for. No torch headers: widely included (the GUI, the CLI, presets).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace diffract::job {

// A job's multi-device strategy (core/parallel/registry.h says which parameters each takes).
struct StrategyParams {
  std::string name;  // a registry name; "" or "single": the plain loop on one device
  int devices = 1;   // devices it runs on: GPUs, or CPU virtual devices for a model on the CPU
  int skip = 2;      // step-skip: evaluate every skip-th step and jump over the others
  int patches = 0;   // pipefusion / cfg-pipefusion: latent row patches, at least one per stage; 0: one per stage
  bool single() const { return name.empty() || name == "single"; }
  std::string display_name() const { return single() ? "single" : name; }
};

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
  std::string device = "cpu";    // "cpu" or "cuda:N": where the model lives (a strategy's first device)
  std::string taesd;             // preview decoder (TAESD folder or .pth files); empty: latent approximation
  int preview_every = 1;         // 0: no previews
  int preview_max_side = kPreviewAuto;  // TAESD previews of larger images decode from latents area-averaged
                                 // down to this many pixels a side (0: full size; auto: preview_side())
  int batch = 1;
  StrategyParams strategy;
  std::vector<int> gpus;         // the GPUs a strategy runs on, in rank order (engine::choose_devices); empty:
                                 // the model's GPU and the ones after it
  bool drop_t5 = false;          // SD3: run without the T5 encoder (its part of the prompt embedding zeros)
  // Job-scope runtime options (core/util/options.h) this job sets for itself, by name.
  std::map<std::string, std::string> options;

  // The previews' largest side in pixels (0: full size). kPreviewAuto, the default, takes
  // half the image's longer side, at most 512, which keeps a TAESD decode per step a small
  // part of a step.
  int preview_side() const {
    if (preview_max_side != kPreviewAuto) return preview_max_side;
    const int half = (width > height ? width : height) / 2;
    return half < 512 ? half : 512;
  }
};

}  // namespace diffract::job
