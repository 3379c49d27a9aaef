#pragma once
// The one job skeleton every model family runs (docs/DESIGN.md): request checks, sampler choice,
// the TAESD cache, initial latents, the plain loop or a strategy's loop, previews, finite checks,
// the decode, metadata and the A1111 text are written here once. A family (stable_diffusion.cpp:
// SD 1.x / 2.x / XL; stable_diffusion_3.cpp: SD3; flux.cpp: Flux.1) supplies the hooks below: what it encodes, its
// denoiser call, its latents and its decode. factory.h picks the family for a model.
#include <any>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <nlohmann/json.hpp>

#include "core/adapters/lora.h"
#include "core/job/job.h"
#include "core/models/autoencoders/taesd.h"
#include "core/pipeline/pipeline_util.h"
#include "core/schedulers/sampler.h"

namespace diffract::parallel {
class Denoiser;
class DeviceGroup;
class Strategy;
}  // namespace diffract::parallel

namespace diffract::pipeline {

// What every family's loaded model holds besides its networks.
struct PipelineState {
  std::filesystem::path path;
  std::string device_name;
  at::Device device{at::kCPU};
  at::ScalarType dtype = at::kFloat;
  std::string taesd_path;         // the loaded preview decoder ("<random>" for random models)
  models::TAESD taesd{nullptr};
  double load_ms = 0;             // reported by the next job, then 0
  detail::StrategyGroups groups;  // multi-device jobs' groups, kept for later jobs
  double replica_ms = 0;          // time spent copying the denoiser to other GPUs
  adapters::LoraPatcher loras;    // the LoRAs patched into the weights now
  // Names the model and its device (checked against the machine); bf16 on CUDA, fp32 on the CPU.
  void open(std::filesystem::path model, const std::string& device);
};

// One job as the skeleton runs it, handed to the hooks.
struct JobContext {
  job::GenerationRequest& req;    // as run: size, sampler resolved
  job::StageTimings& timings;
  schedulers::SamplerKind kind = schedulers::SamplerKind::Euler;
  schedulers::SchedulerConfig config;
  bool cfg = false;               // classifier-free guidance (scale above 1)
  bool use_taesd = false;
  std::any conditioning;          // what the family's encode() made, for its other hooks
  std::vector<double> run_timesteps;  // the timesteps of the steps this pass runs, in order (set before denoiser())
};

// What a job starts from besides its request.
struct JobInputs {
  const parallel::Strategy* strategy = nullptr;  // runs the loop instead of the plain one; null: the request's
  at::Tensor initial_latents;     // [batch, C, h, w] in place of the seed's noise (diffusers' latents=...)
};

// The hooks a family overrides, declared in its class body by this one list (each family defines
// them in its .cpp), so that a hook added here is added to every family at once.
#define DIFFRACT_PIPELINE_HOOKS                                                                        \
 protected:                                                                                           \
  PipelineState& state() override;                                                                    \
  int size_multiple() const override;                                                                 \
  std::string size_multiple_why() const override;                                                     \
  schedulers::SamplerKind choose_sampler(const std::string& requested) const override;                \
  schedulers::SchedulerConfig scheduler_config(schedulers::SamplerKind kind) const override;          \
  std::string a1111_sampler(schedulers::SamplerKind kind) const override;                             \
  int latent_channels() const override;                                                               \
  int denoiser_in_channels() const override;                                                          \
  int vae_factor() const override;                                                                    \
  std::string taesd_hint() const override;                                                            \
  void encode(JobContext& job) override;                                                              \
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> denoiser(JobContext& job) override; \
  void prepare_ranks(JobContext& job, const parallel::Strategy& strategy,                             \
                     parallel::DeviceGroup& group) override;                                          \
  std::unique_ptr<parallel::Denoiser> rank_denoiser(const JobContext& job,                            \
                                                    const parallel::Strategy& strategy, int rank,     \
                                                    const c10::Device& device) override;              \
  double warm_timestep(const JobContext& job, const schedulers::Sampler& sampler) const override;     \
  at::Tensor preview(const at::Tensor& x0, bool use_taesd, int max_side) override;                    \
  at::Tensor decode(const at::Tensor& latents, parallel::DeviceGroup* group) override;                \
  at::Tensor encode_image(const at::Tensor& pixels, at::Generator& generator) override;              \
  void add_metadata(const JobContext& job, nlohmann::json& meta) const override;                      \
  std::string nan_hint() const override;                                                              \
  std::vector<adapters::LoraComponent> lora_components() override;                                    \
  void weights_changed() override;

class Pipeline {
 public:
  virtual ~Pipeline();
  const std::filesystem::path& path() const;
  const std::string& device() const;
  virtual job::ModelFamily family() const = 0;
  virtual int native_size() const = 0;  // pixels, square
  std::string family_label() const;     // "SD 1.x", "SD 2.x", "SDXL", "SD3": for messages
  // The modules a LoRA may patch, per component ("unet", "text_encoder", ...), with their shapes.
  io::LoraModelModules lora_modules();

  // A 2-step job at the native size with CFG and previews so that cuDNN's plans, the CUDA graphs
  // of the default shape and the allocator's pools exist before the first real job. Returns its
  // ms; a no-op (0) on the CPU.
  double warm_up();
  // On a GPU, a 2-step job of the request's size, batch, CFG and previews, once per such shape
  // (graph capture, cuDNN plans, allocator growth), so that its first real job runs at full
  // speed; warm_up() covers the native size at batch 1. Single-device jobs only (strategies warm
  // their ranks themselves). Returns ms; 0 when there was nothing to do.
  double prepare(const job::GenerationRequest& request);

  // Runs one job on the calling thread. Throws diffract::Error with a readable message, or
  // job::Cancelled when `cancel` fires (checked between steps). Running out of memory is such an
  // Error, naming the device, where the job was and its size; the allocator's cached blocks are
  // handed back, so the next job starts from what the models hold.
  job::GenerationResult generate(const job::GenerationRequest& request, const job::JobObserver& observer,
                                 const job::CancelToken& cancel);
  job::GenerationResult generate(const job::GenerationRequest& request, const job::JobObserver& observer,
                                 const job::CancelToken& cancel, const JobInputs& inputs);

 protected:
  virtual PipelineState& state() = 0;
  const PipelineState& state() const { return const_cast<Pipeline*>(this)->state(); }

  // --- the family's hooks ---
  // Pixel sizes must be multiples of this; `why` says what it is made of.
  virtual int size_multiple() const = 0;
  virtual std::string size_multiple_why() const = 0;
  // The sampler for the request's name ("" for the model's own); throws for samplers the
  // family cannot run.
  virtual schedulers::SamplerKind choose_sampler(const std::string& requested) const = 0;
  virtual schedulers::SchedulerConfig scheduler_config(schedulers::SamplerKind kind) const = 0;
  // A1111's name for the sampler in its parameters text ("Euler a", "DPM++ 2M Karras", ...).
  virtual std::string a1111_sampler(schedulers::SamplerKind kind) const = 0;
  virtual int latent_channels() const = 0;
  // The denoiser's input channels: latent_channels(), or 2 * latent_channels() + 1 for an
  // inpainting model (the mask and the masked image's latents follow the latents).
  virtual int denoiser_in_channels() const = 0;
  virtual int vae_factor() const = 0;         // pixels per latent a side
  virtual std::string taesd_hint() const = 0;  // which TAESD fits, for errors ("taesdxl")
  // The prompts' conditioning into job.conditioning (negative with job.cfg); timings into job.timings.
  virtual void encode(JobContext& job) = 0;
  // The single-device denoiser call on a step's model input (the CFG halves as one batch).
  virtual std::function<at::Tensor(const at::Tensor& x_in, const at::Tensor& t)> denoiser(JobContext& job) = 0;
  // Multi-device jobs: replicas on the group's devices (made on this thread before the ranks
  // start), each rank's denoiser, and the timestep the ranks warm up at.
  virtual void prepare_ranks(JobContext& job, const parallel::Strategy& strategy, parallel::DeviceGroup& group) = 0;
  virtual std::unique_ptr<parallel::Denoiser> rank_denoiser(const JobContext& job, const parallel::Strategy& strategy,
                                                            int rank, const c10::Device& device) = 0;
  virtual double warm_timestep(const JobContext& job, const schedulers::Sampler& sampler) const = 0;
  // x0 [1, C, h, w] -> images [1, 3, H, W] in [-1, 1]: TAESD (job.use_taesd) at most max_side
  // pixels a side, else the family's cheapest approximation.
  virtual at::Tensor preview(const at::Tensor& x0, bool use_taesd, int max_side) = 0;
  // Final latents -> images [B, 3, H, W] in [-1, 1]; a multi-device job's group may share the work.
  virtual at::Tensor decode(const at::Tensor& latents, parallel::DeviceGroup* group) = 0;
  // Images [1, 3, H, W] in [-1, 1] (float32, on the CPU) -> the diffusion model's latents
  // [1, C, H / f, W / f] on the model's device: the VAE's posterior sampled with `generator` (as
  // diffusers' retrieve_latents), scaled (and shifted) as decode() undoes.
  virtual at::Tensor encode_image(const at::Tensor& pixels, at::Generator& generator) = 0;
  // The family's own metadata (text encoders used, graphs, decode devices, ...).
  virtual void add_metadata(const JobContext& job, nlohmann::json& meta) const = 0;
  // A hint for a NaN in the CPU loop ("try another sampler or fp32").
  virtual std::string nan_hint() const = 0;
  // The modules LoRAs patch, named as LoRA files name them ("unet", "text_encoder", ...).
  virtual std::vector<adapters::LoraComponent> lora_components() = 0;
  // After the weights changed in place (another set of LoRAs): copies made of them (other GPUs'
  // replicas) are stale.
  virtual void weights_changed() = 0;
  // Before the warm-up job (the SD UNet's memory-format measurement).
  virtual void before_warm_up() {}
  // Whether the job runs classifier-free guidance: a scale above 1 (Flux: and a negative prompt).
  // A job that asks for a scale but is not guided runs, and is recorded, with CFG 1.
  virtual bool guided(const job::GenerationRequest& request) const { return request.cfg > 1.0; }
  // The job's schedule for its size (Flux: the resolution-dependent shift's mu).
  virtual void fit_schedule(schedulers::SchedulerConfig& config, int width, int height) const {}
  // Settings of the family's own for the A1111 parameters text (", Distilled CFG Scale: 3.5").
  virtual std::string a1111_extra(const JobContext& job) const { return ""; }

  // The shared TAESD preview: latents area-averaged down to max_side, then the decoder.
  at::Tensor taesd_preview(const at::Tensor& x0, int vae_factor, int max_side);
  // Latents area-averaged so that they decode to at most max_side pixels a side (0: unchanged).
  static at::Tensor preview_latents(const at::Tensor& x0, int vae_factor, int max_side);

 private:
  job::GenerationResult run_job(const job::GenerationRequest& request, const job::JobObserver& observer,
                                const job::CancelToken& cancel, const JobInputs& inputs);
  // The hires fix's second pass on the first pass's final latents (job.req's size becomes the
  // upscaled one); its steps and previews go to `observer` as a second run of steps.
  at::Tensor hires_pass(JobContext& job, const at::Tensor& latents, at::Generator& gen, bool inpaint_model,
                        const job::JobObserver& observer, const detail::StepReporter::Preview& preview,
                        const job::CancelToken& cancel);

  std::set<std::string> prepared_;
};

}  // namespace diffract::pipeline
