#pragma once
// PipeFusion (xDiT, arXiv 2405.14430) for SD3's MMDiT and Flux's transformer: a model-level
// strategy (DESIGN.md, level 3).
#include <cstdint>
#include <string>
#include <utility>

#include "core/parallel/strategy.h"

namespace diffract::parallel {

// Layers x patches with stale K/V, over a transformer's chain of blocks, driven through the
// denoiser's PipeStage (denoiser.h): SD3's joint blocks; Flux's 19 double-stream then 38
// single-stream blocks, one chain of 57.
//  Stages: rank r runs a contiguous range of the blocks (stage_blocks); rank 0 also embeds
//   (SD3's patch embedding or Flux's x_embedder, and context_embedder), the last rank also runs
//   norm_out / proj_out. Each rank needs only those weights (uses_weight; the pipelines' GPU
//   replicas hold nothing else); every rank embeds the timestep and pooled text itself (and
//   Flux's guidance and its rope rows: a few MB).
//  Patches: the latent split into M row bands of whole token rows (M >= n, default M = n).
//   Pipelined steps stream the items (step i, patch q) in order through the stages: in tick tau
//   rank r runs item tau - r, so after the fill every rank is busy on a different patch.
//  Attention: a block's image queries are the patch's; its image keys and values are all N
//   image tokens, from a per-block cache (models::ImageKV, kept by the rank that owns the block)
//   into which every pass writes its patch's rows first. The other patches' rows are the latest
//   computed: this step's for the patches before it, the previous step's (stale) for the
//   ones after. K/V never travel, which is where PipeFusion saves over a tensor-parallel split.
//  Text stream: both models update the text tokens in every block (they attend to the image
//   too), so each patch carries its own copy of the text state through the stages with its image
//   tokens (as xDiT's PipeFusion passes encoder_hidden_states along), starting from the embedded
//   prompt; the text keys and values a pass attends over are that copy's. SD3 drops it after the
//   last block (context_pre_only); in Flux's single-stream blocks it is the front of the joint
//   sequence, whose image part alone goes into the K/V cache. Flux's rope follows each token:
//   a pass's rows are the text's and its patch's. A pass over the whole image is the model's
//   own forward.
//  Warm-up: the first warmup_steps (>= 1: they fill the caches) are synchronous: the whole image
//   goes through the stages one after the other, no staleness. warmup_steps >= steps is exactly
//   one device.
//  Sampler: the head (rank 0) keeps the latents and steps patch q of step i as soon as its output
//   arrives (a per-element update: flow Euler, Euler, DDIM), which is what lets patch q of step
//   i + 1 start before step i has finished; previews see each step once it is whole.
//  CFG: both branches as one batch of 2B through the stages, combined on the last rank (one
//   pipeline per branch instead with cfg_split, below).
//  Messages, point to point, each one tensor: a pass's image tokens and text state
//   [2B, N/M + S, D] (PipeStage::activation_shape) from rank r to r + 1, and the (guided) output of the patch [B, C, h/M, w]
//   from the last rank to rank 0: n per synchronous step, M * n per pipelined step (none on one
//   device). Per tick the exchange runs as a chain 0 -> 1 -> ... -> n-1 -> 0, each rank
//   receiving before it sends (rank 0 sending first), so blocking sends cannot wait in a cycle.
//  CFG split (cfg_split, "cfg-pipefusion": CFG-parallel x PipeFusion): 2n devices, two copies of
//   the pipeline above. Ranks [0, n) run it on the conditional branch (Branch::Cond), ranks
//   [n, 2n) on the unconditional one (Branch::Uncond), each at batch B instead of 2B; rank r is
//   stage r % n of pipeline r / n and holds that stage's weights (stage_of). Both pipelines run
//   the same schedule (warm-up steps, then the same items in the same ticks), so each keeps its
//   own per-block K/V cache of its branch with the same staleness as the batched pipeline; the
//   tails send their branch's raw output to their heads (rank 0 and rank n). When a patch's
//   output reaches the heads, they swap it: rank 0 sends its cond output to rank n, then
//   receives the uncond one; rank n receives first, then sends. Both heads then hold the same
//   two tensors, combine them (combine_cfg, the same arithmetic) and step the same latent rows,
//   so their latents stay identical and the next step's inputs agree; rank 0 reports the steps
//   and returns the result. No cycle of blocking sends: order the messages of a tick as
//   pipeline 0's chain (0 -> 1 -> ... -> n-1 -> 0), pipeline 1's chain (n -> ... -> 2n-1 -> n),
//   then 0 -> n, then n -> 0; every rank posts its sends and receives in that order, so the
//   earliest message still pending always has both ends waiting on it. Messages per step: the
//   two pipelines' plus the swap, 2n + 2 per synchronous step and M * (2n + 2) per pipelined one
//   (2 and 2M with n = 1, where each head is its whole pipeline: CFG-parallel over patches).
//   Needs CFG.
//  Speed: after the fill the n ranks work on n different patches at once, each through 1/n of
//   the blocks, and only activations of one patch cross a link per tick; the pipeline fills and
//   drains once per job (n - 1 ticks), not once per step. The warm-up steps cost a full model
//   pass each (the stages run one after the other).
struct PipeFusion final : Strategy {
  int n = 2;               // stages (devices of each pipeline)
  int patches = 0;         // M; 0: n
  int warmup_steps = 1;    // synchronous steps first (>= 1)
  bool cfg_split = false;  // "cfg-pipefusion": one pipeline per CFG branch on 2n devices

  std::string name() const override { return cfg_split ? "cfg-pipefusion" : "pipefusion"; }
  int devices() const override { return cfg_split ? 2 * n : n; }
  int patch_count() const { return patches > 0 ? patches : n; }
  // The stage rank `rank` of the group runs (its pipeline's rank).
  int stage_of(int rank) const { return rank % n; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
  // Nothing: the ranks' weights are their stages only (no whole-model call to warm), the stages
  // run eager, and each rank's first stage call comes in the synchronous warm-up step, where the
  // ranks wait their turn anyway.
  void warm(Denoiser& d, const at::Tensor& x, double timestep) const override;

  // Throws for a job this split cannot run: more stages than blocks, or latent rows that do not
  // make M equal bands of whole token rows (patch_size latent rows each).
  void check_shape(std::int64_t layers, std::int64_t latent_height, std::int64_t patch_size) const;
  // Stage `rank` of n: blocks [first, second) of `layers`, sizes differing by at most 1.
  static std::pair<int, int> stage_blocks(int rank, int n, int layers);
  // Whether stage `rank` of n uses the transformer tensor `name` (a diffusers state-dict key) of a
  // chain of `layers` transformer_blocks then `single_layers` single_transformer_blocks (Flux).
  static bool uses_weight(const std::string& name, int rank, int n, int layers, int single_layers = 0);
  // The stage rank `rank` runs under `strategy` and the pipeline's stage count when it is
  // PipeFusion ({rank, 0} for any other strategy: the whole model).
  static std::pair<int, int> rank_stage(const Strategy& strategy, int rank);
  // The messages a step sends (the design above); cfg_split: both pipelines and the heads' swap.
  static int messages_per_step(bool synchronous, int n, int patches, bool cfg_split = false);
};

}  // namespace diffract::parallel
