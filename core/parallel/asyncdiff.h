#pragma once
// AsyncDiff (arXiv 2406.06911) for the SD / SDXL UNet: a model-level strategy (DESIGN.md, level 3).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/parallel/strategy.h"

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
//  Stride S >= 2 (the paper's stride denoising; the reference ships S = 1 and 2 and needs
//   n + S - 1 devices): steps are grouped and each group costs one parallel round.
//   Devices: n + S - 1. Ranks 0..n-1 own components 0..n-1 as above; ranks n..n+S-2 ("helpers")
//   hold a second, third, ... copy of the last component.
//   Groups: as in the reference, a group starts at every step s >= warmup with (s - 1) % S == 0
//   (the reference's alignment to the absolute step, so for S = 2 groups are (1, 2), (3, 4), ...)
//   and holds steps s .. last = min(s + S - 1, steps - 1). Steps between the warm-up and the first
//   group (only when (warmup - 1) % S != 0, e.g. an even warm-up for S = 2) compute nothing and
//   reuse the last warm-up step's eps, as the reference's cached last component does.
//   A group's round: component 0 runs on x_s (the sampler's scaling of step s) and components
//   1..n-1 on their predecessor's state from the previous round (the previous group, or for the
//   first group the last warm-up step), all at the group's last timestep t_last; that last
//   component (rank n-1) gives eps for step last. Helper j (rank n+j) runs the last component on
//   the same state at t_{s+j} and gives eps for step s+j (j < last - s; in a short final group the
//   rest idle). So the staleness is one round, not one step: component k > 0's input h and its
//   crossing skips (from their producers, or by lineage_skips, as for S = 1) were made in the
//   previous round, from x_{s-S} (or the warm-up's x) at that round's t_last; component 0 sees
//   x_s but the timestep t_last, not t_s. Rank 0 then runs the S sampler steps s .. last one
//   after the other with those S eps, as the pipeline's loop would. Per round the model work is
//   one UNet plus S - 1 extra last components, in the time of the largest component.
//   S = 1 is the scheme above exactly. S > 2 is this scheme's natural extension (one helper per
//   extra step of a group); the reference accepts only 1 and 2. Not implemented: the
//   reference's time_shift option.
//  Messages, point to point, one tensor each (a state is packed flat: h then its skips): rank k
//   sends its output state to rank k+1 and the last rank sends eps (guided) to rank 0: n per
//   step, but only eps (1 message) in a stale last step, whose states nobody would consume. Per
//   step the exchange is a chain 0 -> 1 -> ... -> n-1 -> 0 in which every rank but 0 receives
//   before it sends, so blocking sends cannot wait in a cycle. With a stride, rank n-2 also
//   sends its state to each helper that works in the next round (at the last warm-up step and
//   in every round that has a next one), and every helper sends its eps to rank 0; messages
//   count on the step whose round sent them (eps on the step they are for): a warm-up step n
//   (+ the first round's working helpers on the last one), a group's first step 1 + (n - 1 +
//   the next round's working helpers when there is a next round), its other steps 1, a reuse
//   step 0 (messages_per_step).
//  Speed: in a stale step the n ranks run disjoint ~1/n parts of the layers concurrently, so a
//   step costs about the largest component plus the chain's transfers instead of a whole UNet.
//   Warm-up steps cost a whole UNet plus n transfers. On GPUs each rank's component replays a
//   CUDA graph (UNetGraphRunner::forward_range; DIFFRACT_STAGE_GRAPHS=0: eager), captured in
//   warm_rank() before the loop.
//   Stats: rounds = warm-up steps + groups; evaluations = the eps the model produced (steps less
//   the reuse steps).
struct AsyncDiff final : Strategy {
  int n = 2;       // components (devices)
  int warmup = 1;  // synchronous steps first (>= 1)
  int stride = 1;  // S: steps per round after the warm-up; n + S - 1 devices
  bool lineage_skips = false;  // crossing skips as the states carried them, not from their producers

  std::string name() const override { return stride == 1 ? "asyncdiff" : "asyncdiff-stride" + std::to_string(stride); }
  int devices() const override { return n + std::max(stride, 1) - 1; }  // validate() refuses stride < 1
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
  static int messages_per_step(int step, int steps, int warmup, int n, int stride = 1);
  // The step the first stride group starts at (steps when none does), for warmup >= 1.
  static int first_group(int steps, int warmup, int stride);
};

}  // namespace diffract::parallel
