#pragma once
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/io/single_file.h"
#include "core/models/autoencoders/autoencoder_kl.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/text/clip_tokenizer.h"

namespace diffract::pipeline {

// Models from a single-file SD 1.x / 2.x / SDXL checkpoint (see core/io/single_file.h for the
// layouts). Configs are inferred from weight shapes; what shapes cannot say follows the family's
// conventions:
//   UNet: attention heads (SD 1.x: 8 per block; SD 2.x / SDXL: 64-wide heads), 32 norm groups,
//         sample size (64 / 96 / 128); SDXL's addition_time_embed_dim from label_emb's input width
//         minus the pooled text width, over the 6 time ids.
//   VAE:  32 norm groups; scaling 0.18215 (SD 1.x / 2.x) or 0.13025 (SDXL).
//   CLIP: 64-wide heads; quick_gelu for CLIP-L, gelu for OpenCLIP; SD 2.x uses all resblocks but
//         the last (it takes OpenCLIP-H's penultimate layer).
// Models whose shapes break a convention (tiny test models) need `config_dir`.
struct SingleFileOptions {
  // Optional diffusers folder whose unet/, vae/, text_encoder/, text_encoder_2/ config.json replace
  // the inferred configs (as diffusers' from_single_file(..., config=folder) does), and whose
  // scheduler/scheduler_config.json gives the prediction type. Components without a config.json
  // there are inferred.
  std::filesystem::path config_dir;
};

struct SingleFileModels {
  std::filesystem::path path;
  io::SingleFileFamily family = io::SingleFileFamily::SD1;
  // fp32 on the CPU, strictly bound (every key used, none missing); move / cast them afterwards.
  models::UNet2DConditionModel unet{nullptr};
  models::AutoencoderKL vae{nullptr};
  models::CLIPTextModel text_encoder{nullptr};                  // CLIP-L (SD 1.x, SDXL) or OpenCLIP-H (SD 2.x)
  models::CLIPTextModelWithProjection text_encoder_2{nullptr};  // SDXL's OpenCLIP-bigG; null otherwise
  // Single files carry no vocabulary: pair these with the shipped CLIP BPE (make_clip_tokenizer).
  text::CLIPTokenizerOptions tokenizer;                   // SD 1.x, SDXL: pad "<|endoftext|>"; SD 2.x: pad "!"
  std::optional<text::CLIPTokenizerOptions> tokenizer_2;  // SDXL: pad "!"
  // "epsilon" or "v_prediction". Weights do not tell: config_dir's scheduler config decides, else a
  // "v_pred" key (ComfyUI's marker), else SD 2.x means v_prediction (SD 2.1-768, as diffusers
  // assumes for 2.x single files) and the rest epsilon.
  std::string prediction_type = "epsilon";
  std::vector<std::string> configured;  // components whose config came from config_dir: "unet", "vae", ...
};

// Detects the family (io::detect_single_file), maps the keys and builds and binds every model.
// `file` is a .safetensors (memory-mapped; tensors are copied into the models) or a torch.save
// checkpoint (.ckpt / .pth / .pt / .bin, a state dict directly or under "state_dict").
// Errors (diffract::Error) name the file and the problem.
SingleFileModels load_single_file(const std::filesystem::path& file, const SingleFileOptions& options = {});

// Shape inference on a component's mapped state dict (our key layout, as io::map_* return it).
// `pooled_text_dim` is SDXL's second text encoder's projection width (0 otherwise). Errors name `what`.
models::UNet2DConditionConfig infer_unet_config(const io::StateDict& unet, io::SingleFileFamily family,
                                                int64_t pooled_text_dim, const std::string& what);
models::AutoencoderKLConfig infer_vae_config(const io::StateDict& vae, io::SingleFileFamily family,
                                             const std::string& what);
models::CLIPTextConfig infer_clip_text_config(const io::StateDict& text_encoder, const std::string& hidden_act,
                                              const std::string& what);

// The shipped CLIP BPE vocabulary, resources/clip/bpe_simple_vocab_16e6.txt.gz. An explicit `bpe_gz`
// must exist. Otherwise searched next to the executable and in every folder above it (also under
// share/diffract/ there, for installs), then in the source tree this library was built from.
// An error lists every place tried.
std::filesystem::path find_clip_bpe(const std::filesystem::path& bpe_gz = {});
// A tokenizer for a single file's text encoder: the BPE above with `options` (SingleFileModels::tokenizer*).
text::CLIPTokenizer make_clip_tokenizer(const text::CLIPTokenizerOptions& options,
                                        const std::filesystem::path& bpe_gz = {});

}  // namespace diffract::pipeline
