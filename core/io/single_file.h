#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/io/weights.h"

namespace diffract::io {

class SafetensorsArchive;

// Single-file checkpoints: one .safetensors (or .ckpt) holding UNet, VAE and text encoder(s) in the
// original Stability / CompVis key layout that A1111 and ComfyUI use. This file decides what a file
// is and renames its keys to our module names (diffusers' / transformers' keys); assembling models
// from them is core/pipeline/single_file.h.

enum class SingleFileFamily { SD1, SD2, SDXL };
std::string single_file_family_name(SingleFileFamily family);  // "SD 1.x", "SD 2.x", "SDXL"

// A tensor's name and shape: all that detection looks at (never the data).
struct TensorShape {
  std::string name;
  std::vector<int64_t> shape;
};
std::vector<TensorShape> tensor_shapes(const SafetensorsArchive& archive);
std::vector<TensorShape> tensor_shapes(const StateDict& weights);

// Where each component sits in the file, and in which layout.
struct SingleFileLayout {
  SingleFileFamily family = SingleFileFamily::SD1;
  std::string unet_prefix = "model.diffusion_model.";  // LDM (SD 1.x / 2.x) or SGM (SDXL) UNet
  std::string vae_prefix = "first_stage_model.";       // LDM VAE
  // SD 1.x: "cond_stage_model.transformer." (transformers' CLIP-L keys, text_model.*);
  // SD 2.x: "cond_stage_model.model." (OpenCLIP-H keys); SDXL: "conditioner.embedders.0.transformer." (CLIP-L).
  std::string text_encoder_prefix;
  bool text_encoder_open_clip = false;  // SD 2.x
  // SDXL only: "conditioner.embedders.1.model." (OpenCLIP-bigG keys, text_projection included).
  std::string text_encoder_2_prefix;
  int64_t open_clip_blocks = 0;   // resblocks of the OpenCLIP encoder (SD 2.x: one more than it uses)
  int64_t context_dim = 0;        // the UNet's cross-attention width
  bool v_prediction_hint = false; // a top-level "v_pred" key (ComfyUI's marker for v-prediction models)
};

// Decides SD 1.x / 2.x / XL from key names and shapes alone. Anything else is a diffract::Error
// naming the file and what was found: other architectures (SD3, FLUX, SDXL refiner, inpainting,
// instruct-pix2pix, upscaler, unCLIP, Playground v2.5, ControlNet, diffusers-layout files), a file
// with no SD keys at all, or an incomplete one (say a UNet without VAE or text encoder).
SingleFileLayout detect_single_file(const SafetensorsArchive& archive);
SingleFileLayout detect_single_file(const std::vector<TensorShape>& tensors, const std::string& what);

// Key mapping. Each takes the whole file's state dict and returns the component's tensors under our
// module names. Tensors are views (split, transposed or reshaped where the layouts differ), never
// copies. Keys under the prefix that the mapping does not know are kept under their full original
// name, so a strict bind() reports them as unexpected instead of dropping weights silently.

// LDM / SGM UNet (input_blocks / middle_block / output_blocks / time_embed / label_emb / out) ->
// diffusers' UNet2DConditionModel. Block boundaries come from the names (a downsampler "op" ends
// a down block, an upsampler "conv" an up block), so per-block layer counts need no config.
StateDict map_ldm_unet(const StateDict& all, const std::string& prefix = "model.diffusion_model.");

// LDM VAE (encoder.down.N.block.M, mid.block_1, mid.attn_1.{norm,q,k,v,proj_out} as 1x1 convs,
// norm_out, decoder.up.N counted from the bottom) -> diffusers' AutoencoderKL. Training-only
// "loss.*" keys are dropped.
StateDict map_ldm_vae(const StateDict& all, const std::string& prefix = "first_stage_model.");

// transformers' CLIP keys under `prefix` ("cond_stage_model.transformer.", ...) -> text_model.*,
// dropping the position_ids buffer.
StateDict map_sd_clip(const StateDict& all, const std::string& prefix);

// OpenCLIP text tower (token_embedding, positional_embedding, transformer.resblocks.N.{attn.in_proj_*,
// attn.out_proj, ln_1, ln_2, mlp.c_fc, mlp.c_proj}, ln_final, text_projection) -> transformers'
// CLIPTextModel(WithProjection): in_proj split into q / k / v, text_projection (x @ P) transposed
// into a Linear weight. Resblocks from `num_layers` on are dropped (SD 2.x uses 23 of 24; -1 keeps
// all); text_projection only when `with_projection`. logit_scale and attn_mask are dropped.
StateDict map_open_clip(const StateDict& all, const std::string& prefix, int64_t num_layers = -1,
                        bool with_projection = true);

}  // namespace diffract::io
