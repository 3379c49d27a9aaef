#pragma once
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/io/single_file.h"
#include "core/models/autoencoders/autoencoder_kl.h"
#include "core/models/controlnets/controlnet.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/models/text_encoders/t5_encoder.h"
#include "core/models/transformers/flux_transformer_2d.h"
#include "core/models/transformers/sd3_transformer_2d.h"
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
  // FLUX.1: T5 is bound into CPU tensors (fp32) whatever placement is active (the caller puts it
  // where it runs).
  bool t5_on_cpu = false;
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
// `encoder_only`: a ControlNet's (no up blocks or conv_out; the up-block fields mirror the encoder).
models::UNet2DConditionConfig infer_unet_config(const io::StateDict& unet, io::SingleFileFamily family,
                                                int64_t pooled_text_dim, const std::string& what,
                                                bool encoder_only = false);

// A ControlNetModel saved in diffusers' layout as one .safetensors (or torch.save) file, as SDXL
// ControlNets are often shared: its config inferred from the shapes (the family from its added
// embeddings and context width: SDXL and SD 2.x with 64-wide heads, SD 1.x with 8). A file in the
// original lllyasviel layout (zero_convs, input_hint_block) or of anything else is an error saying so.
models::ControlNetModel load_controlnet_file(const std::filesystem::path& file);
models::AutoencoderKLConfig infer_vae_config(const io::StateDict& vae, io::SingleFileFamily family,
                                             const std::string& what);
models::CLIPTextConfig infer_clip_text_config(const io::StateDict& text_encoder, const std::string& hidden_act,
                                              const std::string& what);

// --- SD3 / SD3.5 ---------------------------------------------------------------------------------
// Models from Stability's SD3 single files (io::detect_sd3_single_file for the layout). Configs
// inferred from shapes:
//   transformer: SD3Transformer2DConfig::from_shapes on the mapped keys (depth, width, patch, latent
//                channels, pos_embed_max_size, joint / pooled widths, qk norm, dual-attention blocks;
//                64-wide heads unless the qk-norm weights show the width), sample_size 128.
//   vae:         16-channel AutoencoderKLConfig::sd3() conventions (scaling 1.5305, shift 0.0609),
//                block widths and latent channels from shapes.
//   CLIP-L / G:  64-wide heads; quick_gelu (L) and gelu (G); CLIP-L pooled at the end token (id
//                argmax), CLIP-G at the end token too.
//   T5:          every size from shapes (heads from the relative-position table), gated-gelu when
//                wi_0 / wi_1 are there.
//   scheduler:   FlowMatchEulerDiscrete, shift 3.0.
// `options.config_dir` (a diffusers SD3 folder) replaces any of these with its transformer/, vae/,
// text_encoder/, text_encoder_2/, text_encoder_3/ config.json and scheduler/scheduler_config.json,
// and supplies whole components the file lacks (SD3.5 files ship without text encoders): a missing
// VAE, CLIP-L, CLIP-G or T5 is loaded from the folder's weights when it has them. T5's SentencePiece
// model comes only from config_dir/tokenizer_3 (single files carry none).
struct SD3SingleFileModels {
  std::filesystem::path path;
  io::SD3SingleFileLayout layout;
  // fp32 on the CPU, strictly bound; move / cast them afterwards.
  models::SD3Transformer2DModel transformer{nullptr};
  models::AutoencoderKL vae{nullptr};
  models::CLIPTextModelWithProjection text_encoder{nullptr};    // CLIP-L
  models::CLIPTextModelWithProjection text_encoder_2{nullptr};  // OpenCLIP-bigG
  models::T5Encoder text_encoder_3{nullptr};                    // null: not loaded (see t5)
  // "loaded"; "not in file" (neither the file nor config_dir has T5); "not loaded" (load_t5 false).
  std::string t5 = "not in file";
  bool t5_available = false;                 // the file or config_dir has T5 weights
  std::filesystem::path t5_tokenizer_dir;    // config_dir/tokenizer_3 when it exists; else empty
  text::CLIPTokenizerOptions tokenizer;      // CLIP-L: pad "<|endoftext|>"
  text::CLIPTokenizerOptions tokenizer_2;    // CLIP-G: pad "!"
  std::filesystem::path scheduler_json;      // config_dir's scheduler config, or empty: scheduler_text
  std::string scheduler_text;                // FlowMatchEulerDiscrete, shift 3.0 (when no scheduler_json)
  std::vector<std::string> configured;       // components whose config came from config_dir
  std::vector<std::string> from_config_dir;  // components whose weights came from config_dir
};

// True for a file whose tensor names hold an SD3 MMDiT (joint_blocks.*). A .safetensors reads only
// its header; other formats are not SD3 files (false). Never throws for a readable file.
bool is_sd3_single_file(const std::filesystem::path& file);

// Detects, maps, builds and binds. `load_t5` false leaves T5 unloaded (dropped, or no tokenizer
// for it). Errors (diffract::Error) name the file and the component.
SD3SingleFileModels load_sd3_single_file(const std::filesystem::path& file, const SingleFileOptions& options = {},
                                         bool load_t5 = true);

// Shape inference on a mapped state dict (our keys, as io::map_sd3_t5 returns it).
models::T5EncoderOptions infer_t5_config(const io::StateDict& t5, const std::string& what);

// --- FLUX.1 ---------------------------------------------------------------------------------------
// Models from a FLUX.1 single file (io::detect_flux_single_file for the layouts): BFL's transformer-
// only files, ComfyUI's diffusion-model files and its all-in-one checkpoints, in bf16 / fp16 / fp32 or
// float8 (scaled or not). Configs inferred from shapes:
//   transformer: FluxTransformer2DConfig::from_shapes on the mapped keys (guidance embedding = dev).
//   vae:         the 16-channel AutoencoderKLConfig::flux() conventions (scaling 0.3611, shift 0.1159),
//                block widths from shapes.
//   CLIP-L:      64-wide heads, quick_gelu. T5: every size from shapes.
//   scheduler:   FLUX.1-dev's (dynamic shifting) with the guidance embedding, else schnell's (shift 1).
// `options.config_dir` (a diffusers FLUX.1 folder) replaces any config with its transformer/, vae/,
// text_encoder/, text_encoder_2/ config.json and scheduler/scheduler_config.json (the scheduler only
// when its transformer config agrees on the guidance embedding: schnell's file with dev's folder keeps
// schnell's schedule), and supplies what the file lacks: VAE, CLIP-L and T5 weights, the T5
// tokenizer (tokenizer_2/, or an SD3 folder's tokenizer_3/: single files carry none) and CLIP's
// (tokenizer/; else the shipped BPE).
// Float8 weights: scales are folded in and the tensors become `dtype` when bound
// (io::dequantize_fp8): the model runs in bf16 on the GPU, in fp32 on the CPU.
struct FluxSingleFileModels {
  std::filesystem::path path;
  io::FluxSingleFileLayout layout;
  // Strictly bound (on a placement's device when one is active, else fp32 on the CPU).
  models::FluxTransformer2DModel transformer{nullptr};
  models::AutoencoderKL vae{nullptr};
  models::CLIPTextModel text_encoder{nullptr};
  models::T5Encoder text_encoder_2{nullptr};
  std::filesystem::path clip_tokenizer_dir;  // config_dir/tokenizer, or empty: the shipped BPE
  text::CLIPTokenizerOptions tokenizer;      // for the shipped BPE
  std::filesystem::path t5_tokenizer_dir;    // config_dir/tokenizer_2 or tokenizer_3
  std::filesystem::path scheduler_json;      // config_dir's scheduler config, or empty: scheduler_text
  std::string scheduler_text;
  std::size_t fp8_scaled = 0;                // weights whose float8 scales were folded in
  std::vector<std::string> configured;       // components whose config came from config_dir
  std::vector<std::string> from_config_dir;  // components whose weights came from config_dir
};

// True for a .safetensors file whose tensor names hold a FLUX transformer. Never throws for a
// readable file.
bool is_flux_single_file(const std::filesystem::path& file);

// Detects, maps, builds and binds. Errors (diffract::Error) name the file and the component; a file
// without VAE, CLIP-L or T5 (BFL's) and no config folder holding them says what to give.
FluxSingleFileModels load_flux_single_file(const std::filesystem::path& file, const SingleFileOptions& options,
                                           at::ScalarType dtype);

// FLUX.1-dev's (`dev`) or schnell's scheduler_config.json as their diffusers folders ship it.
std::string flux_scheduler_config(bool dev);

// The shipped CLIP BPE vocabulary, resources/clip/bpe_simple_vocab_16e6.txt.gz. An explicit `bpe_gz`
// must exist. Otherwise searched next to the executable and in every folder above it (also under
// share/diffract/ there, for installs), then in the source tree this library was built from.
// An error lists every place tried.
std::filesystem::path find_clip_bpe(const std::filesystem::path& bpe_gz = {});
// A tokenizer for a single file's text encoder: the BPE above with `options` (SingleFileModels::tokenizer*).
text::CLIPTokenizer make_clip_tokenizer(const text::CLIPTokenizerOptions& options,
                                        const std::filesystem::path& bpe_gz = {});

}  // namespace diffract::pipeline
