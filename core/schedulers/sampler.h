#pragma once
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

namespace diffract::schedulers {

// FlowMatchEuler is for flow-matching models (SD3), whose denoiser predicts the velocity
// v = noise - x0; the others are for epsilon / v-prediction models (SD 1.x, 2.x, XL).
enum class SamplerKind { Euler, EulerAncestral, DDIM, DDPM, DPMPP2M, DPMPP2MKarras, FlowMatchEuler };
enum class Prediction { Epsilon, VPrediction };
enum class Spacing { Leading, Trailing, Linspace };

// "euler", "euler-ancestral", "ddim", "ddpm", "dpmpp-2m", "dpmpp-2m-karras", "flow-euler".
std::optional<SamplerKind> parse_sampler(std::string_view name);
// As parse_sampler, but an unknown name is an error that lists the valid ones.
SamplerKind parse_sampler_or_throw(std::string_view name);
std::string_view sampler_name(SamplerKind kind);
std::vector<std::string> sampler_names();
// Whether the sampler integrates a flow-matching ODE (the model predicts a velocity).
bool is_flow_matching(SamplerKind kind);

// diffusers' spellings: "epsilon" / "v_prediction", "leading" / "trailing" / "linspace".
std::optional<Prediction> parse_prediction(std::string_view name);
std::string_view prediction_name(Prediction p);
std::optional<Spacing> parse_spacing(std::string_view name);
std::string_view spacing_name(Spacing s);

// The settings diffusers' XScheduler.from_config(...) ends up with, for the keys our samplers
// honour. Member defaults are EulerDiscreteScheduler's; defaults(kind) gives each class's own.
struct SchedulerConfig {
  int num_train_timesteps = 1000;
  double beta_start = 0.0001;
  double beta_end = 0.02;
  std::string beta_schedule = "linear";  // linear, scaled_linear, squaredcos_cap_v2
  std::vector<double> trained_betas;     // when not empty, replaces beta_start / beta_end / beta_schedule
  Prediction prediction_type = Prediction::Epsilon;
  Spacing timestep_spacing = Spacing::Linspace;
  int steps_offset = 0;
  bool rescale_betas_zero_snr = false;
  // DDIM
  bool set_alpha_to_one = true;
  // DDIM, DDPM
  bool clip_sample = true;
  double clip_sample_range = 1.0;
  // DDPM: fixed_small, fixed_small_log, fixed_large
  std::string variance_type = "fixed_small";
  // Euler, DPM++ 2M
  bool use_karras_sigmas = false;
  std::optional<double> sigma_min, sigma_max;  // the Karras range; otherwise the schedule's own ends
  std::string final_sigmas_type = "zero";     // zero, sigma_min
  // DPM++ 2M (always dpmsolver++, solver order 2)
  bool lower_order_final = true;
  bool euler_at_final = false;
  std::string solver_type = "midpoint";  // midpoint, heun
  double lambda_min_clipped = -std::numeric_limits<double>::infinity();
  // Flow matching (FlowMatchEulerDiscreteScheduler): the static sigma shift (SD3: 3.0). Only
  // num_train_timesteps and shift apply to it; beta, spacing and prediction settings do not.
  double shift = 1.0;
  // Resolution-dependent shifting (Flux): instead of `shift`, sigma -> e^mu / (e^mu + 1 / sigma - 1)
  // ("exponential"; "linear": mu in place of e^mu), mu set for the job's image by the pipeline
  // (flow_mu) from its token count between base_image_seq_len / base_shift and
  // max_image_seq_len / max_shift, as diffusers' calculate_shift.
  bool use_dynamic_shifting = false;
  std::string time_shift_type = "exponential";
  double base_shift = 0.5, max_shift = 1.15;
  int base_image_seq_len = 256, max_image_seq_len = 4096;
  std::optional<double> mu;
  // The pipeline's sigmas before shifting: false, the training schedule's (SD3); true, Flux's
  // np.linspace(1, 1 / n, n).
  bool linear_sigmas = false;

  // Reads scheduler_config.json: every key that `kind`'s diffusers class takes is read, and an
  // absent one takes that class's default, as XScheduler.from_config(json) does in diffusers
  // 0.42.1 (the Karras kind forces use_karras_sigmas on, plain DPM++ 2M forces it off). Keys of
  // other classes are ignored. Wrong types, unknown values and features these samplers do not
  // implement (thresholding, exponential / beta / Lu sigmas, learned variance, "sample"
  // prediction, ...) are errors naming the file and the key.
  static SchedulerConfig from_json(const std::filesystem::path& scheduler_config_json, SamplerKind kind);
  // The same from JSON text (a built-in config, for single-file checkpoints); `where` names it in errors.
  static SchedulerConfig from_json_text(const std::string& json_text, SamplerKind kind, const std::string& where);
  static SchedulerConfig defaults(SamplerKind kind);
  // diffusers' calculate_shift: mu for an image of `image_seq_len` tokens, linear through
  // (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift).
  double flow_mu(int64_t image_seq_len) const;
  // Throws an error starting with `where` for a value no sampler can run with.
  void validate(const std::string& where) const;
};

// The sampler a model folder asks for: scheduler_config.json's "_class_name" (and
// use_karras_sigmas for DPMSolverMultistepScheduler). std::nullopt when our samplers cannot
// reproduce that scheduler: another class (PNDMScheduler, LMSDiscreteScheduler, ...), or a
// supported class with a feature they lack (SDE / third-order DPM-Solver, thresholding, ...).
std::optional<SamplerKind> native_sampler(const std::filesystem::path& scheduler_config_json);

// One generation's schedule and state. Step i goes from timesteps()[i] to the next noise level;
// a run is step(0) ... step(num_steps() - 1). Arithmetic is float32 (half inputs are upcast),
// and results come back in model_output's dtype, as diffusers does.
class Sampler {
 public:
  // Errors for num_inference_steps outside 1..num_train_timesteps and for invalid configs.
  static std::unique_ptr<Sampler> create(SamplerKind kind, const SchedulerConfig& config, int num_inference_steps);
  virtual ~Sampler();

  SamplerKind kind() const { return kind_; }
  const SchedulerConfig& config() const { return config_; }
  int num_steps() const { return static_cast<int>(timesteps_.size()); }
  // What the denoiser is conditioned on at each step (diffusers' scheduler.timesteps).
  const std::vector<double>& timesteps() const { return timesteps_; }
  // Euler, Euler ancestral, DPM++ 2M, flow Euler: num_steps() + 1 noise levels, the last the
  // final one (0, or sigma_min for final_sigmas_type "sigma_min"). Empty for DDIM and DDPM.
  // Flow Euler's sigmas are the interpolation weights of x = (1 - sigma) * x0 + sigma * noise,
  // and its timesteps sigma * num_train_timesteps.
  const std::vector<double>& sigmas() const { return sigmas_; }
  // What unit-variance initial noise is multiplied by.
  double init_noise_sigma() const { return init_noise_sigma_; }

  // The denoiser's input at step i (Euler samplers divide by sqrt(sigma^2 + 1); others as is).
  virtual at::Tensor scale_model_input(const at::Tensor& sample, int step) const;
  // One ordinary update from step i given the model output (eps or v, per the config; the
  // velocity for flow Euler).
  // DPM++ 2M keeps the previous step's x0 prediction and uses it when this call is step i-1's
  // successor (otherwise it takes a first-order step). `generator` feeds the stochastic samplers
  // (Euler ancestral, DDPM) as diffusers draws: model_output's shape and dtype, on the CPU for a
  // CPU generator and then moved; an undefined generator uses the device's default one.
  virtual at::Tensor step(const at::Tensor& model_output, int i, const at::Tensor& sample, at::Generator generator) = 0;
  // The model's x0 estimate at step i (clipped as the sampler clips it).
  virtual at::Tensor predict_x0(const at::Tensor& model_output, int i, const at::Tensor& sample) const = 0;
  // The state step j would start from, reached from step i (j > i, j <= num_steps()) in one
  // transition: DDIM's deterministic closed form, DDPM's posterior q(x_j | x_i, x0), and one
  // first-order step from sigma_i to sigma_j for Euler, Euler ancestral (with its noise),
  // DPM++ 2M and flow Euler (x + (sigma_j - sigma_i) * v). Leaves step()'s history alone.
  // jump(i, i + 1) equals step(i) for Euler, Euler ancestral, DDIM, DDPM and flow Euler (given
  // the same generator state).
  virtual at::Tensor jump(const at::Tensor& model_output, int i, int j, const at::Tensor& sample,
                          at::Generator generator) const = 0;
  // x0 taken to the noise level step i starts from with `noise`, by the sampler's own forward
  // rule, as diffusers' add_noise (scale_noise for flow Euler) with the schedule begun at step i:
  // sqrt(abar) x0 + sqrt(1 - abar) noise for DDIM / DDPM, x0 + sigma noise for the Euler samplers,
  // alpha x0 + sigma_t noise for DPM++ 2M, (1 - sigma) x0 + sigma noise for flow Euler. In
  // float32, returned in x0's dtype. i == num_steps() gives x0 (the final level).
  virtual at::Tensor add_noise(const at::Tensor& x0, const at::Tensor& noise, int i) const = 0;
  // Forgets multistep history (for re-running the same schedule).
  virtual void reset();

 protected:
  Sampler(SamplerKind kind, SchedulerConfig config) : kind_(kind), config_(std::move(config)) {}
  void check_step(int i) const;
  void check_jump(int i, int j) const;
  void check_level(int i) const;  // 0 <= i <= num_steps()

  SamplerKind kind_;
  SchedulerConfig config_;
  std::vector<double> timesteps_;
  std::vector<double> sigmas_;
  double init_noise_sigma_ = 1.0;
};

// 4-channel inpainting's blend after step i (diffusers' StableDiffusionInpaintPipeline): outside
// `mask` (1: repaint) the latents become `x0` noised with `noise` to the level step i + 1 starts
// from (x0 itself after the last step); inside they stay `latents`.
at::Tensor blend_outside_mask(const Sampler& sampler, int i, const at::Tensor& latents, const at::Tensor& mask,
                              const at::Tensor& x0, const at::Tensor& noise);

}  // namespace diffract::schedulers
