#pragma once
// What a job asks for. No torch headers: widely included (the GUI, the CLI, presets).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/io/image.h"

namespace diffract::job {

// A job's multi-device strategy (core/parallel/registry.h says which parameters each takes).
struct StrategyParams {
  std::string name;  // a registry name; "" or "single": the plain loop on one device
  int devices = 1;   // devices it runs on: GPUs, or CPU virtual devices for a model on the CPU
  int skip = 2;      // step-skip: evaluate every skip-th step and jump over the others; deepcache: its interval
  int patches = 0;   // pipefusion / cfg-pipefusion: latent row patches, at least one per stage; 0: one per stage
  // fbcache, teacache: cached work is reused while the change they measure stays under this; 0
  // reuses nothing; negative: the strategy's default (registry: fbcache 0.12, teacache 0.4).
  double cache_threshold = -1;
  bool single() const { return name.empty() || name == "single"; }
  std::string display_name() const { return single() ? "single" : name; }
};

// What an image-conditioned job starts from (core/pipeline/image_processor.h prepares it as
// diffusers' VaeImageProcessor does). No image: text-to-image; an image: image-to-image; an image
// and a mask: inpainting.
struct ImageInputs {
  static constexpr double kStrengthAuto = -1;  // 0.75 for image-to-image, 1.0 for inpainting
  io::Image image;           // resized to the job's size (Lanczos); the job's size defaults to it
  io::Image mask;            // white = repaint (its grey level binarised at 50 %); resized likewise
  double strength = kStrengthAuto;  // [0, 1]: the last `strength` part of the schedule runs
  int mask_blur = 0;         // px: a Gaussian blur of the mask first (its edge, and the paste-back's feather)
  int full_res_padding = -1; // >= 0: inpaint at full resolution: the mask's box, padded by this many
                             // pixels and grown to the job's aspect, is cut out, generated at the job's
                             // size and pasted back (diffusers' padding_mask_crop); < 0: the whole image
  bool paste_back = false;   // the unmasked pixels of the original over the result, the mask's edge feathered
  // Outpainting: the canvas grows by these many pixels a side, the new area is filled from the
  // image's edge ("edge": its pixels repeated; "blur": the same, blurred) and inpainted, the mask
  // reaching `outpaint_overlap` pixels into the old area so that the seam is repainted too.
  int outpaint_left = 0, outpaint_top = 0, outpaint_right = 0, outpaint_bottom = 0;
  std::string outpaint_fill = "edge";
  int outpaint_overlap = 8;

  bool has_image() const { return image.width > 0 && image.height > 0; }
  bool has_mask() const { return mask.width > 0 && mask.height > 0; }
  bool outpaints() const { return outpaint_left > 0 || outpaint_top > 0 || outpaint_right > 0 || outpaint_bottom > 0; }
  double resolved_strength() const { return strength != kStrengthAuto ? strength : has_mask() ? 1.0 : 0.75; }
};

// Hires fix: after the job's pass, its latents upscaled ("latent": bicubic on the latents;
// "lanczos": decoded, resized in pixels and encoded again) and denoised again from `strength`.
struct HiresFix {
  double scale = 0;          // > 1: the final size over the job's (0: off)
  double strength = 0.5;     // [0, 1]: the part of the second schedule that runs
  std::string upscaler = "latent";
  int steps = 0;             // the second pass's schedule; 0: the job's steps
  bool enabled() const { return scale != 0; }
};

// How the prompts are read. A1111: its attention syntax ("(word:1.3)", "[word]", BREAK) and
// prompts of any length in 75-token chunks (core/text/prompt_syntax.h); plain: diffusers'
// tokenization, the text as written, cut at the encoder's window.
enum class PromptSyntax { A1111, Plain };

// A LoRA (or LyCORIS LoCon / LoHa / LoKr) file applied for the job, its delta scaled as A1111
// does (weight x alpha / rank x up.down).
struct LoraRef {
  std::string path;                  // a .safetensors file
  double weight = 1.0;               // on the denoiser (UNet / transformer)
  double text_encoder_weight = 1.0;  // on the text encoders
  std::string name;                  // how the user named it (<lora:NAME>); empty: the file's stem
};

// A ControlNet for the job (diffusers' StableDiffusion(XL)ControlNetPipeline): its residuals,
// times `scale`, added to the UNet's skips on the steps from `start` to `end` of the schedule.
struct ControlNetRef {
  std::string path;    // a diffusers ControlNetModel folder
  io::Image image;     // the control image (edges, depth, pose, ...), resized to the job's size (Lanczos)
  double scale = 1.0;  // controlnet_conditioning_scale
  double start = 0.0;  // control_guidance_start: the fraction of the steps before it acts
  double end = 1.0;    // control_guidance_end: the fraction of the steps after which it stops
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
  double cfg = 7.0;              // <= 1 disables classifier-free guidance (Flux: true CFG, with a negative prompt)
  double guidance = 3.5;         // Flux.1-dev: the distilled guidance the transformer embeds (others ignore it)
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
  ImageInputs input;            // init image and mask; empty: text-to-image
  HiresFix hires;
  PromptSyntax prompt_syntax = PromptSyntax::A1111;
  std::vector<LoraRef> loras;    // applied in this order; the prompt's <lora:NAME:W> tags are added by the engine
  std::vector<ControlNetRef> controlnets;  // summed, as diffusers' MultiControlNetModel
  bool lora_lenient = false;     // keys a LoRA has that match nothing: a warning instead of an error
  std::vector<std::string> lora_dirs;  // where <lora:NAME> is looked up (then the Hugging Face cache)
  bool drop_t5 = false;          // SD3: run without the T5 encoder (its part of the prompt embedding zeros)
  // Flux: where T5-XXL (9.5 GB in bf16) lives: "" with the model; "cpu" (runs there, fp32);
  // "cuda:N" (another GPU); "offload" (host memory between prompts, the model's GPU to encode).
  std::string t5_placement;
  // The denoiser's linear layers: "" or "bf16" in the model's dtype; "fp8" in e4m3 where that
  // is faster (core/models/common/fp8_linear.h; on the CPU emulated, for its rounding).
  std::string precision;
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
