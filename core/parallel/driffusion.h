#pragma once
#include <vector>

#include "core/parallel/strategy.h"

namespace diffract::parallel {

// DRiffusion draft-and-refine on n devices. With CFG each device evaluates both branches.
//  Conservative: round 1 evaluates the anchor x_i exactly; x_{i+1} = step(eps_i); drafts for
//   steps i+2 .. i+n come from jump(eps_i, i, i+k, x_i), draft i+1 is x_{i+1} itself; round 2
//   evaluates the n drafts in parallel; refinement runs the ordinary step() along the
//   trajectory with the drafts' outputs: x_{i+k+1} = step(eps^_{i+k}, i+k, x_{i+k}). The next
//   anchor is x_{i+n+1}: n+1 steps per 2 rounds (ideal latency 2/(n+1)).
//  Aggressive: anchor and n-1 drafts in one round; the drafts jump from x_i with the previous
//   round's last output (the first round has none, so it evaluates the anchor alone): n steps
//   per round (ideal 1/n).
// With n = 1 both reduce to the ordinary loop.
// cfg_split (CFG-parallel x DRiffusion, "cfg-driffusion(-aggressive)"): 2n devices, rank r
//  evaluates point r / 2 on the prompt (even r) or the negative prompt (odd r), one all_gather
//  per round, and every rank combines the pairs as the pipeline does: the same rounds, each a
//  batch-1 evaluation instead of batch 2. Needs CFG.
// pair_branches: without cfg_split, a round of p points on n >= 2p devices (aggressive mode's
//  first and last rounds, conservative mode's anchor rounds) evaluates them as cfg_split does,
//  a point's two branches on two devices, rather than leaving devices idle: the same rounds,
//  the same trajectory up to batch-1 against batch-2 rounding, and such a round costs a batch-1
//  step (measured well under a batch-2 one, docs/benchmarks.md). Needs CFG; a no-op otherwise.
struct DRiffusion final : Strategy {
  enum class Mode { Aggressive, Conservative };
  int n = 2;
  Mode mode = Mode::Conservative;
  bool cfg_split = false;
  bool pair_branches = true;
  std::string name() const override;
  int devices() const override { return cfg_split ? 2 * n : n; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
  void warm(Denoiser& d, const at::Tensor& x, double timestep) const override;
  // The number of rounds each mode takes for `steps` steps on `n` devices.
  static int expected_rounds(Mode mode, int steps, int n);
  // The points (states evaluated) of each round, in order: expected_rounds() entries summing
  // to `steps`.
  static std::vector<int> round_points(Mode mode, int steps, int n);
};

}  // namespace diffract::parallel
