#pragma once
// Generation parameters recovered from a PNG's text chunks: Diffract's own "diffract" JSON,
// AUTOMATIC1111's "parameters" text, or ComfyUI's "prompt" graph. No torch headers.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/io/image.h"

namespace diffract::engine {

// Every field is set only when the source states it and it maps onto ours.
struct PngParameters {
  std::string source;  // "diffract", "a1111" or "comfyui"
  std::optional<std::string> prompt;
  std::optional<std::string> negative_prompt;
  std::optional<int> width, height, steps, batch, devices, skip;
  std::optional<int> batch_index;  // the image's position in its batch (diffract "batch_index", A1111 "Batch pos")
  std::optional<double> cfg;
  std::optional<double> cache_threshold;  // diffract: fbcache's, teacache's threshold
  std::optional<double> guidance;  // Flux.1-dev's distilled guidance (A1111 / Forge: "Distilled CFG Scale")
  std::optional<std::uint64_t> seed;
  std::optional<std::string> sampler;   // ours ("dpmpp-2m-karras"); "" is the model's own
  std::optional<std::string> model;     // diffract: the path it ran with
  std::optional<std::string> model_name;  // A1111 / ComfyUI: a checkpoint name, not a path
  std::optional<std::string> taesd, device, strategy;
  // diffract: image inputs saved beside the PNG (file names relative to its folder) and their settings.
  std::optional<std::string> input_file, mask_file;
  std::optional<double> strength;
  std::optional<std::string> prompt_syntax;  // diffract: "a1111" or "plain"
  std::optional<std::string> precision;      // diffract: "bf16" or "fp8"
  // diffract: the LoRAs applied (A1111's ride in the prompt as <lora:NAME:W> tags).
  struct Lora {
    std::string name, path;
    double weight = 1.0, text_encoder_weight = 1.0;
  };
  std::vector<Lora> loras;
  // diffract: the ControlNets, with the control image each was given (saved beside the PNG by the
  // GUI, relative to its folder) and how the GUI made it from the user's image.
  struct ControlNet {
    std::string path, image_file;
    std::string preprocessor = "none";
    int low = 100, high = 200;
    double scale = 1.0, start = 0.0, end = 1.0;
  };
  std::vector<ControlNet> controlnets;
  // A1111: "Lora hashes" (name -> its short hash), for finding a LoRA renamed since.
  std::vector<std::pair<std::string, std::string>> lora_hashes;
  // What the source holds that has no counterpart here, one readable line each
  // ("Sampler: LMS Karras (no Diffract sampler)", "Clip skip: 2").
  std::vector<std::string> unmapped;
};

// Tries "diffract", then "parameters", then "prompt". Throws an error starting with `where`
// when none is present ("no generation parameters"), or when those present cannot be read.
PngParameters parse_png_parameters(const io::PngText& text, const std::string& where);
// Reads the PNG (the whole file: libpng meets text chunks after the image data too).
PngParameters read_png_parameters(const std::filesystem::path& png);

// An A1111 / ComfyUI sampler (and scheduler) name as ours; std::nullopt when none of ours matches.
std::optional<std::string> sampler_from_a1111(const std::string& sampler, const std::string& schedule_type = "");
std::optional<std::string> sampler_from_comfyui(const std::string& sampler_name, const std::string& scheduler);

}  // namespace diffract::engine
