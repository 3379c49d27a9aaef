#pragma once
// The model evaluation the parallel strategies drive, apart from the pipeline that owns it.
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/models/controlnets/controlnet.h"
#include "core/models/transformers/flux_transformer_2d.h"
#include "core/models/transformers/sd3_transformer_2d.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/models/unets/unet_graphs.h"

namespace diffract::schedulers {
class Sampler;
}

namespace diffract::parallel {

// Cond: the prompt; Uncond: the negative prompt; Guided: both in one batch, combined with the
// guidance scale (or the prompt alone when CFG is off), as the single-device pipeline does.
enum class Branch { Cond, Uncond, Guided };

// PipeFusion's view of a transformer (pipefusion.h): blocks [first, last) of its chain, run on row
// patches of the latent, every block's attention over the whole image's keys and values from a
// cache of its own (filled by the first pass, which covers the whole image, then updated patch by
// patch). Made by Denoiser::pipe_stage for one branch; it keeps those caches, the embedded prompt
// and the step's time embedding. One per rank, used from that rank's thread only.
class PipeStage {
 public:
  virtual ~PipeStage();
  // One pass over latent rows [row0, row0 + rows) at `timestep`. The head stage (first == 0)
  // takes the model input's rows [B', C, rows, W] (B' the branch's batch: 2B for Guided with
  // CFG), any other the previous stage's activation (activation_shape(rows)). The tail stage
  // (last == the model's blocks) returns the model's raw output for those rows [B', C, rows, W]
  // (not combined), any other its activation: one tensor holding the patch's image tokens and
  // the text state the next stage needs.
  virtual at::Tensor pass(const at::Tensor& in, std::int64_t row0, std::int64_t rows, double timestep) = 0;
  virtual std::vector<std::int64_t> activation_shape(std::int64_t rows) const = 0;
};

// The denoiser's raw output (eps or v) for a model input at one timestep. One object per rank;
// eval() may run on several ranks' threads at once when the ranks share the module (CPU
// virtual devices), so implementations keep no per-call state.
class Denoiser {
 public:
  virtual ~Denoiser();
  virtual at::Tensor eval(const at::Tensor& model_input, double timestep, Branch branch) = 0;
  virtual bool cfg() const = 0;          // true when there is an unconditional branch
  virtual double guidance_scale() const = 0;
  virtual std::int64_t batch() const = 0;
  // eval()'s result type: ranks with nothing to evaluate in a round send zeros of it (NCCL
  // moves bytes, so every rank must send the same type).
  virtual at::ScalarType output_dtype() const = 0;
  // The same denoiser over conditioning rows [begin, begin + count) (data-parallel batches).
  virtual std::unique_ptr<Denoiser> rows(std::int64_t begin, std::int64_t count) const = 0;

  // Sequence parallelism (Ulysses, models/common/sequence_parallel.h): eval() from this rank's
  // share of the image tokens, the attention trading tokens for heads through `exchange`; every
  // rank of the exchange calls it in step with the same arguments and gets the whole output.
  // sequence_parallel(): whether this denoiser can (else eval_sequence_parallel throws).
  virtual bool sequence_parallel() const { return false; }
  virtual at::Tensor eval_sequence_parallel(const at::Tensor& model_input, double timestep, Branch branch,
                                            models::SequenceExchange& exchange);
  // Step caches (models/common/block_cache.h: FirstBlockCache, TeaCache, DeepCache): eval()
  // through `cache`, which the caller keeps between the steps of one loop and whose step / steps
  // it sets before each call (cache.reused: whether this call reused cached work).
  // step_cache(): whether this denoiser runs that kind of cache (else eval_cached throws).
  virtual bool step_cache(const models::StepCache&) const { return false; }
  virtual at::Tensor eval_cached(const at::Tensor& model_input, double timestep, Branch branch,
                                 models::StepCache& cache);

  // PipeFusion (pipefusion.h). pipe_blocks(): the transformer's chain of blocks, 0 when this
  // denoiser cannot be split into stages (then pipe_stage throws). pipe_token_rows(): latent rows
  // per row of tokens (patches must be whole rows of them). pipe_stage(): blocks [first, last)
  // for `branch` over latents height x width. pipe_weights(): the elements of the weights that
  // stage `stage` of `stages` uses (PipeFusion::uses_weight), counted in this rank's model.
  virtual int pipe_blocks() const { return 0; }
  virtual std::int64_t pipe_token_rows() const { return 1; }
  virtual std::unique_ptr<PipeStage> pipe_stage(int first, int last, Branch branch, std::int64_t height,
                                                std::int64_t width);
  virtual std::int64_t pipe_weights(int stage, int stages) const;

  // Hybrid CFG's layer split (UNet2DConditionModelImpl::forward_outer_down, the "U split" at
  // down block `split`), one branch (Cond or Uncond) per call. splits(): the largest valid
  // split (valid ones are 1..splits()), 0 when this denoiser cannot split; the stage calls of
  // such a denoiser throw diffract::Error. Chained on one branch they equal eval().
  virtual int splits() const { return 0; }
  // model_input [B, C, h, w] -> the outer state (h: the inner stage's input).
  virtual models::UNetOuterState outer_down(const at::Tensor& model_input, double timestep, Branch branch, int split);
  // h [B, C', h', w'] (from any step's outer_down) -> the inner output at `timestep`.
  virtual at::Tensor inner(const at::Tensor& h, double timestep, Branch branch, int split);
  // The outer state and an inner output -> eval()'s result [B, C, h, w] for that branch.
  virtual at::Tensor outer_up(models::UNetOuterState state, const at::Tensor& inner, Branch branch, int split);

  // AsyncDiff's sequential layers (UNet2DConditionModelImpl::forward_range): eval() is
  //   stage_output(run_stage(stage_input(x, t, b), 0, L, t, b), b)
  // with L = stage_layers(h, w).size(), and run_stage over [a, b) then [b, c) is [a, c). Any
  // branch; Guided runs both as one batch of 2B with CFG (the state has 2B rows) and
  // stage_output combines them. stage_layers(): the layers with their estimated costs for
  // latents of height x width, empty when this denoiser cannot split (then the other stage
  // calls throw diffract::Error).
  virtual std::vector<models::UNetLayerInfo> stage_layers(std::int64_t height, std::int64_t width) const;
  // model_input [B, C, h, w] -> the state before layer 0 (h: the model input on this device).
  virtual models::UNetStageState stage_input(const at::Tensor& model_input, double timestep, Branch branch);
  // Runs layers [begin, end) on `state` in place at `timestep`: the time embedding is made here
  // (replacing the state's), so a state made at another step runs at this one.
  virtual void run_stage(models::UNetStageState& state, int begin, int end, double timestep, Branch branch);
  // The state after the last layer -> eval()'s result.
  virtual at::Tensor stage_output(const models::UNetStageState& state, Branch branch);
  // The shapes of the state's tensors (h, then the skips) before layer `layer` for this
  // denoiser's batch and `branch`, latents of height x width: what a peer receives.
  virtual std::vector<std::vector<std::int64_t>> stage_shapes(int layer, std::int64_t height, std::int64_t width,
                                                              Branch branch) const;
};

// eps_u + s * (eps_c - eps_u), written as the pipeline writes it.
at::Tensor combine_cfg(const at::Tensor& uncond, const at::Tensor& cond, double scale);
// mean|eps_c - eps_u| / mean|eps_u| (Hybridiff's rel-MAE between the branches) as a 0-d double
// tensor on the inputs' device, so the loop never waits for it (metrics::rel_mae reads it back).
at::Tensor rel_mae_tensor(const at::Tensor& cond, const at::Tensor& uncond);

// Sampler step i's model input and timestep, then eval().
at::Tensor eval_at(Denoiser& d, const schedulers::Sampler& sampler, const at::Tensor& x, int step, Branch branch);

// A UNet2DConditionModel (through its graph runner) with per-branch conditioning ([B, ...] rows
// each). `negative` is empty (undefined context) or scale <= 1 for no CFG. The runner may be
// shared between ranks on the CPU (eager there, no state); on GPUs each rank gets its own
// replica on its device, with its own graphs.
class UNetDenoiser final : public Denoiser {
 public:
  UNetDenoiser(std::shared_ptr<models::UNetGraphRunner> unet, models::UNetConditioning positive,
               models::UNetConditioning negative, double scale, at::ScalarType dtype, at::Device device);
  at::Tensor eval(const at::Tensor& model_input, double timestep, Branch branch) override;
  bool cfg() const override { return cfg_; }
  double guidance_scale() const override { return scale_; }
  std::int64_t batch() const override { return positive_.encoder_hidden_states.size(0); }
  at::ScalarType output_dtype() const override { return dtype_; }
  std::unique_ptr<Denoiser> rows(std::int64_t begin, std::int64_t count) const override;
  int splits() const override;
  models::UNetOuterState outer_down(const at::Tensor& model_input, double timestep, Branch branch, int split) override;
  at::Tensor inner(const at::Tensor& h, double timestep, Branch branch, int split) override;
  at::Tensor outer_up(models::UNetOuterState state, const at::Tensor& inner, Branch branch, int split) override;
  std::vector<models::UNetLayerInfo> stage_layers(std::int64_t height, std::int64_t width) const override;
  models::UNetStageState stage_input(const at::Tensor& model_input, double timestep, Branch branch) override;
  void run_stage(models::UNetStageState& state, int begin, int end, double timestep, Branch branch) override;
  at::Tensor stage_output(const models::UNetStageState& state, Branch branch) override;
  std::vector<std::vector<std::int64_t>> stage_shapes(int layer, std::int64_t height, std::int64_t width,
                                                      Branch branch) const override;
  // DeepCache (the fbcache analogue on a UNet is a DeepCache refreshed by threshold), through the
  // sequential stage calls: graphed per layer range on GPUs.
  bool step_cache(const models::StepCache& cache) const override;
  at::Tensor eval_cached(const at::Tensor& model_input, double timestep, Branch branch,
                         models::StepCache& cache) override;

  // ControlNets in every eval(): units whose images have one branch's rows (batch()), and the
  // run's timesteps, where a timestep's index is its step (the units' start / end). The split
  // and stage calls refuse a denoiser with ControlNets (the registry keeps such strategies away).
  void set_controlnets(std::vector<models::ControlNetUnit> units, std::vector<double> timesteps);

 private:
  void no_controlnets(const char* what) const;
  const models::UNetConditioning& branch_conditioning(Branch branch) const;
  // Any branch: Guided is both_ with CFG, else the prompt.
  const models::UNetConditioning& conditioning(Branch branch) const;

  std::shared_ptr<models::UNetGraphRunner> unet_;
  models::UNetConditioning positive_, negative_, both_;  // both_: [negative; positive]
  double scale_;
  bool cfg_;
  at::ScalarType dtype_;
  at::Device device_;
  std::vector<models::ControlNetUnit> controls_;
  std::vector<double> timesteps_;
};

// One branch's text conditioning for the transformer families: the text sequence [B, S, D] and the
// pooled vector [B, P] (SD3: CLIP-L + G pooled and the joint CLIP / T5 sequence; Flux: T5's
// prompt_embeds and CLIP-L's pooled output).
struct TextConditioning {
  at::Tensor context, pooled;
};
using SD3Conditioning = TextConditioning;
using FluxConditioning = TextConditioning;

// What the transformer families' denoisers share: per-branch conditioning moved to the device,
// CFG as one batch of [negative; positive] combined with the scale, and row slicing. A family
// says how one batch is evaluated (velocity()) and how it is rebuilt over other rows (with()).
// CFG needs `negative` given and scale > 1. The module may be shared between CPU ranks (no state
// per call).
class TransformerDenoiser : public Denoiser {
 public:
  at::Tensor eval(const at::Tensor& model_input, double timestep, Branch branch) final;
  at::Tensor eval_sequence_parallel(const at::Tensor& model_input, double timestep, Branch branch,
                                    models::SequenceExchange& exchange) final;
  // FirstBlockCache and TeaCache.
  bool step_cache(const models::StepCache& cache) const final;
  at::Tensor eval_cached(const at::Tensor& model_input, double timestep, Branch branch,
                         models::StepCache& cache) final;
  bool cfg() const final { return cfg_; }
  double guidance_scale() const final { return scale_; }
  std::int64_t batch() const final { return positive_.context.size(0); }
  at::ScalarType output_dtype() const final { return dtype_; }
  std::unique_ptr<Denoiser> rows(std::int64_t begin, std::int64_t count) const final;

  // Guided: [negative; positive] with CFG (the batch order eval() combines), else the prompt.
  const TextConditioning& conditioning(Branch branch) const;
  at::ScalarType dtype() const { return dtype_; }
  const at::Device& device() const { return device_; }

 protected:
  TransformerDenoiser(TextConditioning positive, TextConditioning negative, double scale, at::ScalarType dtype,
                      at::Device device);
  // The model's output for `x` (on the device, in dtype) with conditioning rows matching x's;
  // with `exchange`, sequence-parallel (only where sequence_parallel() says so); with `cache`,
  // through that step cache (a FirstBlockCache or a TeaCache; one of the two at most).
  virtual at::Tensor velocity(const at::Tensor& x, const TextConditioning& c, double timestep,
                              models::SequenceExchange* exchange, models::StepCache* cache) = 0;
  virtual std::unique_ptr<Denoiser> with(TextConditioning positive, TextConditioning negative) const = 0;
  double scale() const { return scale_; }

 private:
  at::Tensor evaluate(const at::Tensor& model_input, double timestep, Branch branch, models::SequenceExchange* exchange,
                      models::StepCache* cache);
  TextConditioning positive_, negative_, both_;
  double scale_;
  bool cfg_;
  at::ScalarType dtype_;
  at::Device device_;
};

// SD3's MMDiT (eager: no CUDA graphs) as the SD3 pipeline's loop calls it; sequence-parallel
// (Ulysses over the image tokens); PipeFusion's stages over its joint blocks. No layer split
// (splits() = 0): hybrid-cfg's U split has no MMDiT counterpart.
class SD3Denoiser final : public TransformerDenoiser {
 public:
  SD3Denoiser(models::SD3Transformer2DModel model, SD3Conditioning positive, SD3Conditioning negative, double scale,
              at::ScalarType dtype, at::Device device);
  models::SD3Transformer2DModel& model() { return model_; }
  bool sequence_parallel() const override { return true; }
  int pipe_blocks() const override { return static_cast<int>(model_->config.num_layers); }
  std::int64_t pipe_token_rows() const override { return model_->config.patch_size; }
  std::unique_ptr<PipeStage> pipe_stage(int first, int last, Branch branch, std::int64_t height,
                                        std::int64_t width) override;
  std::int64_t pipe_weights(int stage, int stages) const override;

 private:
  at::Tensor velocity(const at::Tensor& x, const TextConditioning& c, double timestep,
                      models::SequenceExchange* exchange, models::StepCache* cache) override;
  std::unique_ptr<Denoiser> with(TextConditioning positive, TextConditioning negative) const override;
  models::SD3Transformer2DModel model_;
};

// Flux's transformer (eager) on unpacked latents [B, 16, h, w] as the Flux pipeline's loop calls
// it: packed, with the distilled `guidance` when the model embeds it, unpacked again. True CFG
// when `negative` is given and scale > 1. Sequence-parallel (Ulysses over the image tokens);
// PipeFusion's stages over its double- then single-stream blocks (a token row: 2 latent rows).
class FluxDenoiser final : public TransformerDenoiser {
 public:
  FluxDenoiser(models::FluxTransformer2DModel model, FluxConditioning positive, FluxConditioning negative,
               double scale, double guidance, at::ScalarType dtype, at::Device device);
  models::FluxTransformer2DModel& model() { return model_; }
  double guidance() const { return guidance_; }
  bool sequence_parallel() const override { return true; }
  int pipe_blocks() const override { return static_cast<int>(model_->num_blocks()); }
  std::int64_t pipe_token_rows() const override { return 2; }
  std::unique_ptr<PipeStage> pipe_stage(int first, int last, Branch branch, std::int64_t height,
                                        std::int64_t width) override;
  std::int64_t pipe_weights(int stage, int stages) const override;

 private:
  at::Tensor velocity(const at::Tensor& x, const TextConditioning& c, double timestep,
                      models::SequenceExchange* exchange, models::StepCache* cache) override;
  std::unique_ptr<Denoiser> with(TextConditioning positive, TextConditioning negative) const override;
  models::FluxTransformer2DModel model_;
  double guidance_;
};

// The transformer's call on packed latents for one step, as diffusers' FluxPipeline makes it:
// timestep = t (0..1000) in the latents' dtype / 1000, guidance [B] in float32 (or undefined
// when the model has no guidance embedding), the rope of zero text ids and the image's ids.
// With `exchange` each rank runs its even share of the image tokens (SequenceShard::even) and
// all-gathers the outputs: the same result on every rank.
// With `cache` the transformer runs through that step cache (FluxTransformer2DModel::forward_cached
// for a FirstBlockCache, forward_teacached for a TeaCache).
at::Tensor flux_velocity(models::FluxTransformer2DModel& model, const at::Tensor& latents, const at::Tensor& context,
                         const at::Tensor& pooled, double timestep, double guidance,
                         models::SequenceExchange* exchange = nullptr, models::StepCache* cache = nullptr);

}  // namespace diffract::parallel
