#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

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
  bool fp8 = false;  // stored as an 8-bit float (e4m3 / e5m2)
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

// lllyasviel's ControlNet layout (ControlNet 1.0 / 1.1 files, A1111's extracted ones): the UNet
// encoder's LDM keys plus zero_convs.N.0 (-> controlnet_down_blocks.N), middle_block_out.0
// (-> controlnet_mid_block) and input_hint_block.{0, 2, ...} (the first -> conv_in, the last ->
// conv_out, those between -> blocks.0, 1, ...), under "control_model." or bare. Tensors of a
// bundled base model (outside "control_model.") are dropped; `dropped` counts them.
bool is_ldm_controlnet(const StateDict& all);
StateDict map_ldm_controlnet(const StateDict& all, std::size_t* dropped = nullptr);

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

// --- SD3 / SD3.5 ----------------------------------------------------------------------------------
// Stability's SD3 files (sd3_medium_incl_clips*.safetensors, sd3.5_*.safetensors):
//   model.diffusion_model.*              the MMDiT (joint_blocks.N.{x,context}_block with fused qkv,
//                                        pos_embed, x_embedder, t_embedder, y_embedder,
//                                        context_embedder, final_layer); bare (no prefix) in
//                                        transformer-only files
//   first_stage_model.*                  the 16-channel LDM VAE
//   text_encoders.clip_l.transformer.*   CLIP-L, transformers' keys (text_model.*)
//   text_encoders.clip_g.transformer.*   OpenCLIP-bigG, transformers' keys (+ text_projection)
//   text_encoders.t5xxl.transformer.*    T5-XXL encoder, transformers' keys (optional)
// SD3.5 files hold only the MMDiT and VAE; the text encoders then come from elsewhere
// (core/pipeline/single_file.h: the config folder).

// True when the tensors hold an MMDiT (joint_blocks.N.*, with or without model.diffusion_model.).
bool is_sd3_single_file(const std::vector<TensorShape>& tensors);

struct SD3SingleFileLayout {
  std::string transformer_prefix = "model.diffusion_model.";  // or "" for a bare MMDiT
  // Empty when the file lacks the component.
  std::string vae_prefix, clip_l_prefix, clip_g_prefix, t5_prefix;
  // The MMDiT's shape facts (checked against each other at detection).
  int64_t depth = 0;         // joint blocks
  int64_t hidden_size = 0;   // x_embedder's output width
  int64_t in_channels = 0;   // latent channels
  int64_t patch_size = 0;
  int64_t pos_embed_max_size = 0;
  int64_t joint_attention_dim = 0;    // context_embedder's input width
  int64_t pooled_projection_dim = 0;  // y_embedder's input width
  bool qk_norm = false;               // ln_q / ln_k (SD3.5)
  std::vector<int64_t> dual_attention_layers;  // blocks with x_block.attn2 (SD3.5 medium)
  std::string variant;  // "SD3 medium", "SD3.5 medium", "SD3.5 large" or "SD3-like" (other sizes)
};

// Decides the SD3 layout from names and shapes (never the data). The MMDiT must be complete (every
// fixed tensor, every joint block numbered 0..N-1 with its qkv, consistent widths) and a VAE present
// must give the MMDiT's latent channels; errors name `what`, the component and the tensor. Missing
// text encoders or VAE are not errors here: the loader decides where they come from.
SD3SingleFileLayout detect_sd3_single_file(const std::vector<TensorShape>& tensors, const std::string& what);

// The MMDiT -> diffusers' SD3Transformer2DModel keys, as diffusers' convert_sd3_transformer_checkpoint_to_diffusers:
// fused qkv split into to_q/to_k/to_v (x_block) and add_q_proj/add_k_proj/add_v_proj (context_block),
// ln_q/ln_k -> norm_q/norm_k (norm_added_q/k for the context), attn.proj -> to_out.0 / to_add_out,
// adaLN_modulation.1 -> norm1 / norm1_context .linear, mlp.fc1/fc2 -> ff(_context).net.0.proj / net.2,
// attn2 (SD3.5 medium) likewise. The original final layer and the last block's context norm
// chunk their modulation (shift, scale); diffusers' AdaLayerNormContinuous takes (scale, shift): those
// two are swapped (a copy, the only tensors that are not views).
StateDict map_sd3_transformer(const StateDict& all, const std::string& prefix = "model.diffusion_model.");

// SD3's CLIP encoders (transformers' keys under `prefix`) -> text_model.* + text_projection.weight.
// A file without CLIP-L's text_projection gets the identity (as diffusers' from_single_file gives
// SD3's CLIP-L): its pooled output is then the pooled hidden state.
StateDict map_sd3_clip(const StateDict& all, const std::string& prefix);

// SD3's T5 (transformers' T5EncoderModel keys under `prefix`) -> our T5Encoder's (shared.weight,
// encoder.*; the tied encoder.embed_tokens folded in as map_t5_encoder_keys does).
StateDict map_sd3_t5(const StateDict& all, const std::string& prefix);

// --- FLUX.1 ---------------------------------------------------------------------------------------
// Black Forest Labs' files (flux1-dev.safetensors, flux1-schnell.safetensors: the transformer alone,
// bare keys), the same under model.diffusion_model. (ComfyUI's UNet / diffusion_models files), and
// ComfyUI's all-in-one checkpoints, which add
//   text_encoders.clip_l.transformer.*   CLIP-L, transformers' keys (text_model.*)
//   text_encoders.t5xxl.transformer.*    T5-XXL encoder, transformers' keys
//   vae.* or first_stage_model.*         the 16-channel LDM VAE (BFL's ae.safetensors keys)
// Transformer weights may be float8 (e4m3 / e5m2), with or without per-tensor or per-channel scales
// (`X.scale_weight` or `X.weight_scale` beside `X.weight`; ComfyUI's "scaled" files).

// True when the tensors hold a FLUX.1 transformer (double_blocks.N.img_attn.*, with or without
// model.diffusion_model.).
bool is_flux_single_file(const std::vector<TensorShape>& tensors);

struct FluxSingleFileLayout {
  std::string transformer_prefix;  // "" (BFL) or "model.diffusion_model."
  // Empty when the file lacks the component.
  std::string vae_prefix, clip_l_prefix, t5_prefix;
  int64_t double_blocks = 0, single_blocks = 0;
  int64_t hidden_size = 0;   // img_in's output width
  int64_t head_dim = 0;      // the query norm's width
  int64_t in_channels = 0;   // packed latent channels (4 x the VAE's)
  int64_t joint_attention_dim = 0, pooled_projection_dim = 0;
  bool guidance = false;     // guidance_in: dev-style distilled guidance
  bool fp8 = false;          // some tensors of the file are float8 (any component)
  bool fp8_scaled = false;   // ... with scales beside them
  std::string variant;       // "FLUX.1-dev", "FLUX.1-schnell" or "FLUX-like" (other sizes)
};

// Decides the layout from names and shapes (never the data). The transformer must be complete:
// every fixed tensor, double and single blocks numbered 0..N-1 with their projections, consistent
// widths; errors name `what` and the tensor. FLUX.2 and the image-conditioned FLUX.1 (Fill, Depth,
// Canny: more input than output channels) are refused by name. Missing text encoders or VAE are not errors here.
FluxSingleFileLayout detect_flux_single_file(const std::vector<TensorShape>& tensors, const std::string& what);

// BFL's transformer keys -> diffusers' FluxTransformer2DModel, as diffusers'
// convert_flux_transformer_checkpoint_to_diffusers: img_in / txt_in -> x_embedder / context_embedder,
// time_in / vector_in / guidance_in {in,out}_layer -> time_text_embed.{timestep,text,guidance}_embedder
// .linear_{1,2}, double_blocks.N.{img,txt}_mod.lin -> norm1(_context).linear, {img,txt}_attn.qkv split
// into to_q/k/v and add_{q,k,v}_proj, their norm.{query,key}_norm.scale -> norm_q/k (norm_added_q/k),
// {img,txt}_attn.proj -> to_out.0 / to_add_out, {img,txt}_mlp.{0,2} -> ff(_context).net.{0.proj,2},
// single_blocks.N.linear1 split into to_q, to_k, to_v (the width each) and proj_mlp (the rest),
// linear2 -> proj_out, modulation.lin -> norm.linear, final_layer.linear -> proj_out and
// final_layer.adaLN_modulation.1 -> norm_out.linear with its (shift, scale) halves swapped (a copy;
// everything else is a view). Weight scales must have been folded in (dequantize_fp8).
StateDict map_flux_transformer(const StateDict& all, const std::string& prefix = "");

// Folds float8 weight scales into their weights: every `X.scale_weight` / `X.weight_scale` (a
// scalar, [out] or [out, 1]) multiplies `X.weight` (computed in float32, stored as `dtype`), and
// is removed with the activation scales (`scale_input`, `input_scale`) and ComfyUI's "scaled_fp8"
// marker (under any prefix). Unscaled float8 tensors stay as they are (binding converts them exactly: e4m3 and e5m2
// values are bf16 / fp32 values). `scaled` counts the weights scaled. Errors name `what` and the key.
StateDict dequantize_fp8(const StateDict& all, at::ScalarType dtype, const std::string& what,
                         std::size_t* scaled = nullptr);

}  // namespace diffract::io
