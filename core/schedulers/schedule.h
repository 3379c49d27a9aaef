#pragma once
// Noise schedules as pure functions. diffusers keeps its schedules in float32 tensors and
// numpy float64 arrays by turns; each function returns the values diffusers ends up with
// (float32 ones stored exactly in doubles), so that samplers reproduce it step for step.
#include <string>
#include <optional>
#include <vector>

#include "core/schedulers/sampler.h"

namespace diffract::schedulers {

// The training betas (float32). Throws for a schedule other than linear, scaled_linear and
// squaredcos_cap_v2.
std::vector<double> betas(const std::string& beta_schedule, int num_train_timesteps, double beta_start,
                          double beta_end);
// Rescaled to zero terminal SNR (Lin et al. 2023, algorithm 1), in float32.
std::vector<double> rescale_zero_terminal_snr(const std::vector<double>& betas);
// cumprod(1 - betas) (float32).
std::vector<double> alphas_cumprod(const std::vector<double>& betas);
// The config's betas (trained_betas or beta_schedule, zero-SNR rescaled when asked) -> alphas_cumprod.
std::vector<double> alphas_cumprod(const SchedulerConfig& config);
// sqrt((1 - a) / a) per training timestep, ascending in t (float32).
std::vector<double> training_sigmas(const std::vector<double>& alphas_cumprod);
// log of each (float32), for sigma_to_t.
std::vector<double> log_sigmas(const std::vector<double>& training_sigmas);

// Inference timesteps, descending, exactly n of them:
//   leading:  (0, r, 2r, ..) reversed + steps_offset, r = T // n
//   trailing: round(T, T - T/n, ..) - 1
//   linspace: n evenly spaced values from T - 1 to 0; `integer` rounds them half to even
//             (DDIM, DDPM), otherwise they stay float32 (Euler).
std::vector<double> spaced_timesteps(Spacing spacing, int num_train_timesteps, int n, int steps_offset, bool integer);
// DPMSolverMultistepScheduler's variant: n + 1 points up to last_timestep with the smallest
// dropped (leading, linspace); trailing as above from last_timestep.
std::vector<double> dpm_timesteps(Spacing spacing, int num_train_timesteps, int last_timestep, int n, int steps_offset);
// T minus the number of training timesteps whose log-SNR lambda is below lambda_min_clipped.
int lambda_clipped_last_timestep(const std::vector<double>& alphas_cumprod, double lambda_min_clipped);

// The training sigmas linearly interpolated at (fractional) timesteps, clamped at the ends.
std::vector<double> interpolate_sigmas(const std::vector<double>& training_sigmas,
                                       const std::vector<double>& timesteps);
// Karras et al. 2022: n sigmas from sigma_max down to sigma_min, evenly spaced in sigma^(1/rho).
std::vector<double> karras_sigmas(double sigma_min, double sigma_max, int n, double rho = 7.0);
// The fractional training timestep at which the log-sigma curve reaches log(sigma).
double sigma_to_t(double sigma, const std::vector<double>& log_sigmas);

// Flow matching (SD3), as diffusers' FlowMatchEulerDiscreteScheduler with a static shift:
// sigma -> shift * sigma / (1 + (shift - 1) * sigma), which moves the schedule towards noise.
double flow_shift(double sigma, double shift);
// The n inference sigmas (float32, descending, without the final 0): n points evenly spaced in
// timestep between the shifted training ends (shift(1) and shift(1 / T), in float32) and each
// shifted again in float64, as diffusers does (the shift is applied twice, by design of its
// implementation). The timesteps are these sigmas * T in float32.
std::vector<double> flow_match_sigmas(int num_train_timesteps, int n, double shift);
// Resolution-dependent shifting (Flux): sigma -> e^mu / (e^mu + (1 / sigma - 1)), or with
// `linear` mu / (mu + (1 / sigma - 1)).
struct FlowTimeShift {
  double mu = 0;
  bool linear = false;
};
// The n sigmas diffusers' FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=..., mu=...)
// ends with (float32, descending, without the final 0). Before shifting: with `linear_sigmas`
// the pipeline's np.linspace(1, 1 / n, n) as float32 (Flux), else the training schedule's
// evenly spaced timesteps / T in float64 (its ends unshifted under a time shift). Then the time
// shift when given, else the static shift, in the precision of those sigmas.
std::vector<double> flow_match_sigmas(int num_train_timesteps, int n, double shift,
                                      const std::optional<FlowTimeShift>& time_shift, bool linear_sigmas);

// x rounded to float32, as a double.
inline double f32(double x) { return static_cast<double>(static_cast<float>(x)); }

}  // namespace diffract::schedulers
