#pragma once
// Pieces the text-to-image pipelines share: device names, image conversion, and the reporter of a
// denoising loop's steps and previews.
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "core/job/job.h"
#include "core/io/image.h"
#include "core/schedulers/sampler.h"
#include "core/util/device_work.h"

namespace diffract::schedulers {
class Sampler;
}
namespace diffract::parallel {
class DeviceGroup;
class Strategy;
struct LoopInputs;
struct LoopStats;
}  // namespace diffract::parallel
namespace torch::nn {
class Module;
}
namespace diffract::io {
class ScopedPlacement;
}
namespace diffract::text {
class CLIPTokenizer;
}

namespace diffract::pipeline::detail {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0);

// "cpu", "cuda", "cuda:N": checked against the machine's devices.
at::Device parse_device(const std::string& name);

// [B, 3, H, W] in [-1, 1] -> [B, H, W, 3] bytes on the input's device, rounded as diffusers'
// PIL conversion does.
at::Tensor to_bytes(const at::Tensor& x);
std::vector<io::Image> bytes_to_images(const at::Tensor& bytes);
std::vector<io::Image> to_images(const at::Tensor& x);

std::string format_number(double v);

// A prompt's CLIP token ids [1, max_length] on `device`, the time added to timings.tokenize_ms;
// a warning when the prompt was cut off at the tokenizer's limit.
at::Tensor clip_token_ids(const text::CLIPTokenizer& tokenizer, const std::string& prompt, const at::Device& device,
                          job::StageTimings& timings);

// A tokenizer whose ids reach past the text encoder's embedding table (`vocab_size` rows) is
// refused at load, naming both; the lookup would otherwise fail mid-job.
void check_tokenizer_fits(const text::CLIPTokenizer& tokenizer, int64_t vocab_size, const std::string& what);

// The checks every job gets before any work starts: a zero width or height becomes `native`;
// the size must be a positive multiple of `multiple` (`why`: what that multiple is) and at most
// 8192 a side; CFG scale, batch and preview settings in range.
void check_request(job::GenerationRequest& req, int native, int multiple, const std::string& why);
// 1 <= steps <= the model's training timesteps.
void check_steps(const job::GenerationRequest& req, int train_timesteps);

// For a model loaded onto a GPU: weights go from the checkpoint through pinned buffers straight
// onto it, in `dtype` (io::ScopedPlacement, for as long as the result lives). Null on the CPU and
// with DIFFRACT_PINNED_UPLOAD=0 (weights bound into CPU tensors, the module moved afterwards).
std::unique_ptr<io::ScopedPlacement> placement_for(const at::Device& device, at::ScalarType dtype);
// Logs what a placement moved.
void log_placement(const io::ScopedPlacement* placement, const std::string& what);

// A flow-matching model's scheduler (SD3, Flux): its scheduler_config.json, or, without a file
// (single files, random models), the config itself as JSON text.
struct FlowMatchingScheduler {
  std::filesystem::path json;
  std::string text;
  std::optional<schedulers::SamplerKind> native;  // what the config's class runs, when known
  void set_file(const std::filesystem::path& scheduler_config_json);
  void set_text(std::string config_text);  // a FlowMatchEulerDiscreteScheduler's config
  // flow-euler, or `requested` when it names a flow-matching sampler; any other is an error
  // naming `family` ("SD3", "Flux").
  schedulers::SamplerKind choose(const std::string& requested, const std::string& family) const;
  // `what`: where the text came from, for its errors.
  schedulers::SchedulerConfig config(schedulers::SamplerKind kind, const std::string& what) const;
};

// A 2-step job with a preview every step through `run`, so that graphs, cuDNN plans and the
// previews' stream exist before the first real job; logs and returns its ms.
double warm_up(const std::string& device, const std::string& taesd,
               const std::function<void(const job::GenerationRequest&, const job::JobObserver&)>& run);

// Reports the steps and previews of a denoising loop without holding the device back: step
// times come from marks in its stream, previews decode on a side stream and reach the
// observer when done; a preview due while the last one still decodes is dropped.
class StepReporter {
 public:
  // x0 [1, C, h, w] (the sampler's prediction, diffusion latent space) -> images [1, 3, H, W] in [-1, 1].
  using Preview = std::function<at::Tensor(const at::Tensor& x0)>;
  // `first_step`: the loop runs the sampler's steps from there (image-to-image); events count from
  // it. A job of two loops (the hires fix) numbers its events on: the second loop's start at
  // `event_offset`, both reporting `event_total` steps (0: this loop's own count).
  StepReporter(const c10::Device& device, const job::GenerationRequest& req, const job::JobObserver& observer,
               const schedulers::Sampler& sampler, Preview preview, job::StageTimings& timings, int first_step = 0,
               int event_offset = 0, int event_total = 0);

  // After step i's work is enqueued: its model output and the state it started from.
  void stepped(int i, const at::Tensor& out, const at::Tensor& before);
  void cached(int i) { cached_.insert(i); }  // step i's evaluation reused cached blocks (before stepped)
  void finish();

 private:
  void drain();
  void deliver(const SideStreamTask::Done& d);

  const job::GenerationRequest& req_;
  const job::JobObserver& observer_;
  const schedulers::Sampler& sampler_;
  Preview preview_;
  job::StageTimings& timings_;
  int first_;
  int offset_, total_;  // what step events say: index + offset_ of total_
  StepClock clock_;
  SideStreamTask previews_;
  int reported_ = 0;
  std::set<int> cached_;
};

// Where an image-conditioned loop starts, and what 4-channel inpainting keeps outside its mask.
struct LoopImage {
  int first_step = 0;        // the steps before it are skipped (diffusers' get_timesteps for a strength)
  // Latent blending (diffusers' StableDiffusionInpaintPipeline for models without mask inputs):
  // after each step, latents = (1 - mask) * image_latents noised to the next step's level with
  // `noise` + mask * latents. Undefined mask: none.
  at::Tensor mask;           // [B, 1, h, w], 1: repaint
  at::Tensor image_latents;  // [B, C, h, w]
  at::Tensor noise;          // [B, C, h, w]: the initial noise
};

// The plain single-device loop of both pipelines: each step's model input (the CFG halves as one
// batch, [negative; prompt], when `cfg_scale` > 1), `model(x_in, timesteps)` on it, the halves
// combined (parallel::combine_cfg), the sampler's step and the reporter told. Cancellation is
// checked before each step; on the CPU a step that produces NaN or Inf is an error (`nan_hint`
// says what to try). Returns the final latents.
at::Tensor denoise(schedulers::Sampler& sampler, at::Tensor latents, at::Generator& gen, double cfg_scale,
                   const std::function<at::Tensor(const at::Tensor& x_in, const at::Tensor& timesteps)>& model,
                   StepReporter& reporter, const job::CancelToken& cancel, const std::string& nan_hint,
                   const LoopImage& image = {});

// The groups the multi-device strategies (core/parallel) run on: CPU virtual devices for a
// model on the CPU (made per job); for a model on a GPU, the job's GPUs, kept with their NCCL
// communicators for later jobs.
class StrategyGroups {
 public:
  StrategyGroups();
  ~StrategyGroups();
  // `gpus`: the GPUs in rank order (job::GenerationRequest::gpus; the first holds the model);
  // empty: the model's GPU and the ones after it. CPU models get virtual devices.
  parallel::DeviceGroup& group_for(const c10::Device& model_device, const parallel::Strategy& strategy,
                                   const std::vector<int>& gpus = {});

 private:
  std::unique_ptr<parallel::DeviceGroup> virtual_, gpu_;
  std::vector<int> gpu_ids_;
};

// `src`'s parameters and buffers copied into `dst` (the same structure, built without init) on
// device `d`, device to device; the ones `keep` refuses (by state-dict name) become empty
// tensors there, for replicas that run part of a model.
void copy_weights(torch::nn::Module& src, torch::nn::Module& dst, const c10::Device& d,
                  const std::function<bool(const std::string&)>& keep = {});

// Logs a replica made on `d` ("SD3 transformer replica (stage 0/2) on cuda:1 in 850 ms").
void log_replica(const std::string& what, const c10::Device& d, double ms);

// A transformer's replicas on the GPUs of strategies' groups, one per GPU: the whole model or one
// PipeFusion stage's weights (the others empty), copied from the pipeline's own model device to
// device on first use. The own model serves its device and CPU ranks (shared, read-only).
template <class Model>
class TransformerReplicas {
 public:
  // `name` for the log; `ready` runs on each new copy (fusing its projections).
  explicit TransformerReplicas(std::string name, std::function<void(Model&)> ready = {})
      : name_(std::move(name)), ready_(std::move(ready)) {}
  // The model on `d` (`own` lives on `own_device`), holding stage `stage` of `stages` (0 stages:
  // the whole model) as `keep` names it (a state-dict name filter for that stage). Adds the
  // copying time to `replica_ms`.
  Model on(Model& own, const c10::Device& own_device, const c10::Device& d, int stage, int stages,
           const std::function<bool(const std::string&)>& keep, double& replica_ms) {
    if (d == own_device || d.is_cpu()) return own;
    const std::string what = stages > 0 ? "stage " + std::to_string(stage) + "/" + std::to_string(stages) : "whole";
    const auto key = std::make_pair(static_cast<int>(d.index()), what);
    if (const auto it = replicas_.find(key); it != replicas_.end()) return it->second;
    // One replica per GPU: a whole one and a stage's would otherwise sit side by side.
    for (auto it = replicas_.begin(); it != replicas_.end();)
      it = it->first.first == d.index() ? replicas_.erase(it) : std::next(it);
    const auto t0 = Clock::now();
    Model copy(own->config);  // no init: each tensor is then copied or emptied
    copy->eval();
    copy_weights(*own, *copy, d, stages > 0 ? keep : std::function<bool(const std::string&)>());
    if (ready_) ready_(copy);
    replica_ms += ms_since(t0);
    log_replica(name_ + " replica (" + what + ")", d, ms_since(t0));
    replicas_.emplace(key, copy);
    return copy;
  }
  bool empty() const { return replicas_.empty(); }
  void clear() { replicas_.clear(); }

 private:
  std::string name_;
  std::function<void(Model&)> ready_;
  std::map<std::pair<int, std::string>, Model> replicas_;
};

// A strategy's denoising loop as the pipelines run it: on GPUs every rank first evaluates the
// loop's shapes (Strategy::warm on `warm_input`'s shape and dtype at `warm_timestep`), one device
// at a time, so that no rank captures graphs or autotunes while its peers wait in a collective;
// steps and previews go through a StepReporter on rank 0's thread. Returns the final latents;
// `stats` gets the strategy's statistics (JSON, the job metadata's "strategy").
at::Tensor run_strategy_loop(const parallel::Strategy& strategy, parallel::DeviceGroup& group, parallel::LoopInputs in,
                             const at::Tensor& warm_input, double warm_timestep, const job::GenerationRequest& req,
                             const job::JobObserver& observer, StepReporter::Preview preview,
                             job::StageTimings& timings, parallel::LoopStats& stats);

}  // namespace diffract::pipeline::detail
