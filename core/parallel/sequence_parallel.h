#pragma once
// Sequence parallelism, Ulysses flavour (xDiT's USP with ulysses_degree = n; DeepSpeed-Ulysses,
// arXiv 2309.14509), for Flux and SD3: a model-level strategy (DESIGN.md, level 3).
//  Every rank holds the whole transformer and the whole latents, and evaluates each step together
//  with the others: rank r embeds and runs image tokens [r N/n, (r+1) N/n) (the text tokens on every
//  rank), and around each attention an all-to-all trades tokens for heads, so each rank attends
//  over all N image tokens and the text for H/n of the heads (models::ulysses_attention); the
//  text's output is all-gathered, the image's goes back by a second all-to-all. The shards'
//  outputs are all-gathered at the end of the step and every rank steps the same sampler on the
//  same output: the result is one device's up to rounding.
//  Needs: H (24 for Flux.1 and SD3.5 large, 24 for SD3 medium) and the image tokens ((h/16) * (w/16)
//  at h x w for both) divisible by n. SD3's joint attention puts the image first and the text
//  after it; Ulysses takes the text first, which changes nothing without positions or a mask.
//  SD3.5 medium's image-only attn2 runs the same way without text.
//  CFG: both branches as one batch of 2B on every rank (cfg-parallel is the way to split them).
//  Messages per step and block: q, k, v in (3 all-to-alls), the image output back (1) and the text
//  output (1 all-gather), each 1/n of the attention's activations per rank; plus one all-gather of
//  the output per step. No weights are split, so each GPU needs the whole model (24 GB for Flux).
#include <cstdint>
#include <string>

#include "core/parallel/strategy.h"

namespace diffract::parallel {

struct SequenceParallel final : Strategy {
  int n = 2;

  std::string name() const override { return "sequence-parallel"; }
  int devices() const override { return n; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
  // Every rank evaluates its shard in step with the others, so warming one rank alone would wait
  // for its peers in the first all-to-all: nothing is warmed (the first step captures nothing
  // either: the sharded call runs eager).
  void warm(Denoiser& d, const at::Tensor& x, double timestep) const override;
};

}  // namespace diffract::parallel
