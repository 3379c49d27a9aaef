#pragma once
// The strategy interface (docs/DESIGN.md, "Where a strategy plugs in"). A strategy takes the
// sampler settings, the initial latents and a denoiser per rank, and runs the whole denoising
// loop on a DeviceGroup. Every rank keeps its own sampler replica and generator copy and replays
// the same sampler arithmetic on the exchanged model outputs, so the ranks stay in lock-step
// with one exchange per round. The registry (registry.h) makes them by name; each lives in a
// file named after it.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "core/job/job.h"
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
  const job::CancelToken* cancel = nullptr;
  // On rank 0's thread before on_step of a step whose model evaluation reused cached blocks.
  std::function<void(int step)> on_cached;
  // Image inputs (strategies whose registry entry takes them): the loop starts at `first_step`;
  // with a blend mask, after each step the latents outside it become the image's latents noised
  // to the next step's level (4-channel inpainting, as pipeline::detail::LoopImage).
  int first_step = 0;
  at::Tensor blend_mask, blend_image_latents, blend_noise;
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
  // Step caches: the threshold (negative: none), the steps that reused cached work, and the
  // model work the loop ran in full evaluations' worth (estimated; negative: not a step cache),
  // so that steps / model_work is the cache's speed-up of the denoiser.
  double cache_threshold = -1;
  std::vector<int> reused_steps;
  double model_work = -1;
  std::string note;
  // Where a job's time goes around the loop, set by the pipeline (ms; negative: not measured):
  // the ranks' warm-up, the loop itself, set-up before it, the step reporter's finish after it
  // (waiting for the steps queued ahead of the device), and from the job's start to the
  // strategy's call, the whole call, and from its return to the decode.
  double warm_ms = -1, loop_ms = -1, setup_ms = -1, finish_ms = -1;
  double before_call_ms = -1, call_ms = -1, after_call_ms = -1;
  std::vector<std::int64_t> peak_memory_per_rank;  // GPUs: bytes allocated at the loop's peak
  nlohmann::json json() const;
  std::string to_json() const { return json().dump(); }
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

}  // namespace diffract::parallel
