#pragma once
// AsyncDiff (arXiv 2406.06911) for the SD / SDXL UNet: a model-level strategy (DESIGN.md, level 3).
#include <cstdint>
#include <string>
#include <vector>

#include "core/parallel/strategies.h"

namespace diffract::parallel {

// The UNet cut into n sequential components, one per rank, run concurrently on one-step-stale
// inputs.
//  Components: the UNet's flat execution order (Denoiser::stage_layers,
//   UNet2DConditionModelImpl::forward_range: conv_in, every down resnet(+attention) and
//   downsampler, the mid block's two halves, every up resnet(+attention) and upsampler, the
//   head) split into n contiguous ranges, so the model is component_{n-1} o ... o component_0.
//   The ranges minimise the largest component's estimated cost (balanced_split over
//   UNetLayerInfo::cost: multiply-adds at the job's latent size, self-attention's T^2 term
//   included), not their parameter counts: SDXL's high-resolution layers have few weights and
//   many FLOPs. Component k runs on rank k.
//  Warm-up: the first `warmup` steps (>= 1) are synchronous: x_t goes through the components one
//   after the other (each waits for the previous one's state), which is one device's
//   evaluation, bit for bit. warmup >= steps is exactly one device.
//  Stale steps t >= warmup: component 0 runs on x_t; component k > 0 runs on the state
//   component k-1 produced at step t-1, at step t's timestep. That state is h and every skip
//   connection crossing boundary k (made by the down path before it, not yet consumed by the
//   up path); the skips travel with h, one message per boundary. Exactly what is stale, then:
//   h, the output of component k-1 at step t-1; every crossing skip, as its producer (the
//   component j < k owning the layer that made it) made it at step t-1, as in the reference
//   implementation, where every module's output of the step before is what the other ranks
//   use. That costs no extra message: every rank receives before it sends, so rank k-1, having
//   received the state rank k-2 made at t-1, swaps the skips it carried in from t-2 for those
//   (already refreshed the same way) before sending. With lineage_skips the swap is off and a
//   skip made by component j reaches component k as the states carried it, made at step
//   max(t-(k-j), warmup-1); component k's input is then one consistent partial pass
//   (components 0..k-1 on x_{t-k}, component i at step t-k+i's timestep). For n = 2 the two are
//   the same. Fresh in both: the timestep (each component embeds t itself, with SDXL's added
//   embedding), the text conditioning (each rank has its own copy) and everything a component
//   computes inside itself. eps_t is the last component's output; rank 0 alone runs the
//   sampler on it.
//  CFG: both branches as one batch of 2B through every component, combined on the last rank.
//   Splitting the branches over 2n devices is not implemented (the group must have n devices).
//  Stride (the paper's stride denoising, S steps per component result; the reference runs S = 2
//   on n + 1 devices): only S = 1, other values are refused.
//  Messages, point to point, one tensor each (a state is packed flat: h then its skips): rank k
//   sends its output state to rank k+1 and the last rank sends eps (guided) to rank 0: n per
//   step, but only eps (1 message) in a stale last step, whose states nobody would consume. Per
//   step the exchange is a chain 0 -> 1 -> ... -> n-1 -> 0 in which every rank but 0 receives
//   before it sends, so blocking sends cannot wait in a cycle.
//  Speed: in a stale step the n ranks run disjoint ~1/n parts of the layers concurrently, so a
//   step costs about the largest component plus the chain's transfers instead of a whole UNet.
//   Warm-up steps cost a whole UNet plus n transfers. On GPUs each rank's component replays a
//   CUDA graph (UNetGraphRunner::forward_range; DIFFRACT_STAGE_GRAPHS=0: eager), captured in
//   warm_rank() before the loop.
struct AsyncDiff final : Strategy {
  int n = 2;       // components (devices)
  int warmup = 1;  // synchronous steps first (>= 1)
  int stride = 1;  // S; only 1 is implemented
  bool lineage_skips = false;  // crossing skips as the states carried them, not from their producers

  std::string name() const override { return "asyncdiff"; }
  int devices() const override { return n; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
  // Runs every component once, chained (one guided evaluation through the stages), so that a
  // GPU rank's first eager stage calls (cuDNN autotuning, allocator growth) never happen while
  // a peer waits in NCCL. Nothing for a denoiser that cannot split (run() refuses it).
  void warm(Denoiser& d, const at::Tensor& x, double timestep) const override;
  // Rank `rank`'s component alone, on a zero state of the shapes it receives in the loop (rank 0:
  // the model input), so that the rank captures its component's CUDA graph (one: the others'
  // would only hold memory) before the loop. Nothing for a denoiser that cannot split.
  void warm_rank(Denoiser& d, const at::Tensor& x, double timestep, int rank) const override;

  // n + 1 boundaries 0 = b_0 < b_1 < ... < b_n = cost.size() minimising the largest
  // sum(cost[b_k .. b_{k+1})) (dynamic programming; deterministic). Throws when n > cost.size().
  static std::vector<int> balanced_split(const std::vector<double>& cost, int n);
  // The messages step `step` of `steps` sends (the design above).
  static int messages_per_step(int step, int steps, int warmup, int n);
};

}  // namespace diffract::parallel
