#pragma once
// Multi-device denoising loops (DESIGN.md "Where a strategy plugs in": loop and evaluation
// levels). Each takes the sampler settings, the initial latents and a denoiser per rank, and
// runs the whole loop on a DeviceGroup. Every rank keeps its own sampler replica and generator
// copy and replays the same sampler arithmetic on the exchanged model outputs, so the ranks
// stay in lock-step with one exchange per round. PipeFusion (pipefusion.h, model level) is a
// Strategy too, driving an SD3 denoiser's transformer blocks itself.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "core/engine/generation.h"
#include "core/parallel/denoiser.h"
#include "core/parallel/device_group.h"
#include "core/schedulers/sampler.h"

namespace diffract::parallel {

struct LoopInputs {
  schedulers::SamplerKind kind = schedulers::SamplerKind::Euler;
  schedulers::SchedulerConfig config;
  int steps = 0;
  at::Tensor latents;      // initial latents (noise * init_noise_sigma), [B, C, h, w]
  at::Generator generator; // its state after drawing the initial noise; each rank gets a copy
  // The denoiser of a rank on its device (a replica on GPUs; CPU ranks may share one module).
  std::function<std::unique_ptr<Denoiser>(int rank, const c10::Device& device)> make_denoiser;
  // On rank 0's thread after each refined step i: the output it used, the state before, after.
  std::function<void(int step, const at::Tensor& model_output, const at::Tensor& before, const at::Tensor& after)> on_step;
  const engine::CancelToken* cancel = nullptr;
};

struct LoopStats {
  std::string strategy;
  int devices = 1;
  int steps = 0;
  int rounds = 0;             // sequential model-evaluation rounds (the latency unit)
  int evaluations = 0;        // model evaluations over all devices (a Guided one counts once)
  int paired_rounds = 0;      // DRiffusion: rounds whose points ran their two CFG branches on two devices
  std::int64_t bytes_sent = 0;  // over all ranks
  std::vector<double> rel_mae;  // CFG-parallel / hybrid: per step
  int tau1 = -1, tau2 = -1;     // hybrid
  // PipeFusion: point-to-point messages and their bytes per step (by the step whose work they
  // carry), and the weights (parameters and buffers) each rank's stage uses.
  std::vector<std::int64_t> messages_per_step, bytes_per_step, weights_per_rank;
  std::string note;
  std::string to_json() const;
};

struct LoopOutput {
  at::Tensor latents;  // final, on rank 0's device
  LoopStats stats;
};

class Strategy {
 public:
  virtual ~Strategy();
  virtual std::string name() const = 0;
  virtual int devices() const = 0;
  // Throws diffract::Error when the job cannot run this way (device count, batch, CFG).
  virtual void validate(std::int64_t batch, bool cfg) const = 0;
  virtual LoopOutput run(DeviceGroup& group, const LoopInputs& in) const = 0;
  // Evaluates once each input shape run() gives a rank's denoiser (`x`: the initial latents on
  // its device), so that GPU ranks capture their CUDA graphs before the loop rather than while
  // their peers wait in a collective. Default: the guided batch.
  virtual void warm(Denoiser& d, const at::Tensor& x, double timestep) const;
  // warm() for rank `rank` of the group run() will use, on that rank's thread (what the pipeline
  // calls): strategies whose ranks run different calls warm only the rank's own. Default: warm().
  virtual void warm_rank(Denoiser& d, const at::Tensor& x, double timestep, int rank) const;
};

// One device, the pipeline's own loop (the reference).
struct SingleDevice final : Strategy {
  std::string name() const override { return "single"; }
  int devices() const override { return 1; }
  void validate(std::int64_t, bool) const override {}
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
};

// Conditional branch on rank 0, unconditional on rank 1, one all_gather per step. Exact
// (up to batch-1 vs batch-2 rounding). Records rel-MAE per step.
struct CfgParallel final : Strategy {
  std::string name() const override { return "cfg-parallel"; }
  int devices() const override { return 2; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
  void warm(Denoiser& d, const at::Tensor& x, double timestep) const override;
};

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
//  step (17.8 against 29.5 ms for SDXL 1024² on an H200). Needs CFG; a no-op otherwise.
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

// The batch split in contiguous rows over n devices (sizes differ by at most 1); latents
// gathered at the end. Equal to one device for deterministic samplers; stochastic ones (Euler
// ancestral, DDPM) draw their noise per slice, so their images differ.
struct DataParallel final : Strategy {
  int n = 2;
  std::string name() const override { return "data-parallel"; }
  int devices() const override { return n; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
  void warm(Denoiser& d, const at::Tensor& x, double timestep) const override;
};

// Naive baseline at a given speed-up: one device, evaluate every `skip`-th step and jump over
// the others (jump(i, i + skip)); ceil(steps / skip) rounds.
struct StepSkipping final : Strategy {
  int skip = 2;
  std::string name() const override { return "step-skip"; }
  int devices() const override { return 1; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
};

// "single", "cfg-parallel", "hybrid-cfg", "driffusion" / "driffusion-aggressive" (n devices),
// "cfg-driffusion" / "cfg-driffusion-aggressive" (n devices, even: n / 2 drafts per round),
// "data-parallel" (n), "step-skip" (skip = n), "pipefusion" (n stages, `patches` patches; 0: n;
// SD3 only, core/parallel/pipefusion.h), "asyncdiff" (n sequential UNet components,
// core/parallel/asyncdiff.h), "asyncdiff-stride<S>" (AsyncDiff's stride denoising, S steps a
// round: n - S + 1 components on n devices).
std::unique_ptr<Strategy> make_strategy(const std::string& name, int n, int patches = 0);

}  // namespace diffract::parallel
