#pragma once
#include <vector>

#include "core/parallel/strategy.h"

namespace diffract::parallel {

// Hybridiff's switching rule. slope[t] is the least-squares slope of rel_mae[t-L+1 .. t]
// (defined from t = L-1; NaN before). tau1 = the first t with 0 <= slope[t] < eps, or
// tau_cap when none comes first (tau1 <= tau_cap). tau2 = tau1 + k. Steps in [tau1, tau2)
// run the layer-split one-step-stale mode, the others CFG-parallel. Only rel_mae[0..t] decides
// whether t is tau1, so the rule can run online.
struct HybridWindow {
  int tau1 = 0, tau2 = 0;
  std::vector<double> slopes;
};
HybridWindow hybrid_cfg_window(const std::vector<double>& rel_mae, int L, double eps, int tau_cap, int k);

// Hybrid CFG scheduling (Hybridiff, arXiv 2602.21760; SDXL defaults): CFG-parallel outside
// a window, a layer-split one-step-stale pipeline (AsyncDiff's, as Hybridiff's SDXL split) in it.
//  When: the rule above runs online on the CFG-parallel rel-MAE; it fires at tau1 (after that
//   step). Step tau1 + 1 fills the pipeline: an ordinary CFG-parallel step run through the
//   stages, keeping their activations. Steps tau1 + 2 .. tau2 (k - 1 of them, within the loop)
//   are stale; later steps are CFG-parallel again. (The reference also spends the first window
//   step on a full pass; its output there is the cond branch alone, ours is guided.)
//  Split: the UNet's "U split" at down block `split` (Denoiser::outer_down). Rank 0 (Cond) owns
//   the outer stage: conv_in, down_blocks[..split), the up layers after the inner skips, the
//   output head. Rank 1 (Uncond) owns the inner stage: down_blocks[split..], mid, the first up
//   layers. Default split: the last down block, the reference's SDXL split (down_blocks[2], mid,
//   up_blocks[0]'s first two layers inside).
//  Staleness: at stale step i rank 0 runs its outer stage on x_i with the Cond conditioning,
//   taking the inner output rank 1 made at step i-1 in place of a fresh one; rank 1 runs the
//   inner stage at t_i with the Uncond conditioning on the inner input h_{i-1} rank 0 made at
//   step i-1 (h of the Cond branch). eps_i is rank 0's output alone: as in the reference, there
//   is no CFG combination in the window (the branches are mixed through the layers instead).
//  Exchange per stale step, point to point: h_i (rank 0 -> 1) and the inner output (1 -> 0)
//   when step i+1 is stale, eps_i (0 -> 1) so rank 1 replays the sampler. The fill step adds
//   h and the inner output to CFG-parallel's all_gather.
//  Speed-up: the ranks run disjoint halves of the layers at batch 1 concurrently, so a stale
//   step costs about the larger stage instead of a whole UNet. The stage calls replay CUDA
//   graphs on GPUs (UNetGraphRunner; DIFFRACT_STAGE_GRAPHS=0: eager), captured in warm();
//   stats.rel_mae is NaN for stale steps (no pair of branches there).
struct HybridCfg final : Strategy {
  int L = 12;
  double eps = 4e-4;
  int tau_cap = 15;
  int k = 5;
  int split = -1;  // the first inner down block; -1: the last one
  std::string name() const override { return "hybrid-cfg"; }
  int devices() const override { return 2; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
  // The CFG-parallel steps' graph shape (one branch), then the window's three stage calls (every
  // rank runs all three in the fill step).
  void warm(Denoiser& d, const at::Tensor& x, double timestep) const override;
};

}  // namespace diffract::parallel
