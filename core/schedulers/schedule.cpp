#include "core/schedulers/schedule.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "core/util/error.h"

namespace diffract::schedulers {

namespace {

// The float32 schedules go through ATen so that linspace, cumprod and friends round exactly as
// the torch calls in diffusers do.
at::Tensor to_f32_tensor(const std::vector<double>& v) {
  return at::tensor(at::ArrayRef<double>(v), at::kDouble).to(at::kFloat);
}

std::vector<double> to_vector(const at::Tensor& t) {
  const auto d = t.to(at::kDouble).contiguous();
  const double* p = d.data_ptr<double>();
  return std::vector<double>(p, p + d.numel());
}

// numpy.linspace(start, stop, num)[k] in float64.
double linspace_at(double start, double stop, int num, int k) {
  if (num > 1 && k == num - 1) return stop;
  if (num <= 1) return start;
  return k * ((stop - start) / (num - 1)) + start;
}

// numpy.arange(start, 0, -step) for a float step: the length is ceil(start / step) and
// element i is start + i * (second - start), with the second element start - step.
std::vector<double> arange_down(double start, double step) {
  const auto length = static_cast<int64_t>(std::ceil((0.0 - start) / -step));
  std::vector<double> v;
  const double delta = (start + -step) - start;
  for (int64_t i = 0; i < length; ++i) v.push_back(i == 0 ? start : i == 1 ? start + -step : start + i * delta);
  return v;
}

// Trailing spacing: round half to even, minus one. For some step counts (61, 103, ...) the
// float arange yields one extra element just above 0, which diffusers keeps as timestep -1;
// it is dropped here.
std::vector<double> trailing(double start, double step_ratio) {
  std::vector<double> out;
  for (double v : arange_down(start, step_ratio)) {
    const double t = std::nearbyint(v) - 1;
    if (t >= 0) out.push_back(t);
  }
  return out;
}

}  // namespace

std::vector<double> betas(const std::string& beta_schedule, int num_train_timesteps, double beta_start,
                          double beta_end) {
  const int64_t T = num_train_timesteps;
  if (beta_schedule == "linear") return to_vector(at::linspace(beta_start, beta_end, T, at::kFloat));
  if (beta_schedule == "scaled_linear")
    return to_vector(at::linspace(std::pow(beta_start, 0.5), std::pow(beta_end, 0.5), T, at::kFloat).pow(2));
  if (beta_schedule == "squaredcos_cap_v2") {
    // Nichol & Dhariwal's cosine alpha_bar, discretized, betas capped at 0.999.
    const auto alpha_bar = [](double t) { return std::pow(std::cos((t + 0.008) / 1.008 * M_PI / 2), 2); };
    std::vector<double> b;
    for (int64_t i = 0; i < T; ++i) {
      const double t1 = static_cast<double>(i) / T, t2 = static_cast<double>(i + 1) / T;
      b.push_back(f32(std::min(1 - alpha_bar(t2) / alpha_bar(t1), 0.999)));
    }
    return b;
  }
  throw Error("unknown beta_schedule '" + beta_schedule + "' (expected linear, scaled_linear or squaredcos_cap_v2)");
}

std::vector<double> rescale_zero_terminal_snr(const std::vector<double>& betas) {
  const auto alphas = 1.0 - to_f32_tensor(betas);
  auto s = at::cumprod(alphas, 0).sqrt();
  const auto s0 = s[0].clone(), sT = s[-1].clone();
  s -= sT;
  s *= s0 / (s0 - sT);
  const auto abar = s.pow(2);
  const auto a = at::cat({abar.slice(0, 0, 1), abar.slice(0, 1) / abar.slice(0, 0, -1)});
  return to_vector(1.0 - a);
}

std::vector<double> alphas_cumprod(const std::vector<double>& betas) {
  return to_vector(at::cumprod(1.0 - to_f32_tensor(betas), 0));
}

std::vector<double> alphas_cumprod(const SchedulerConfig& c) {
  auto b = c.trained_betas.empty() ? betas(c.beta_schedule, c.num_train_timesteps, c.beta_start, c.beta_end)
                                   : to_vector(to_f32_tensor(c.trained_betas));
  if (c.rescale_betas_zero_snr) b = rescale_zero_terminal_snr(b);
  return alphas_cumprod(b);
}

std::vector<double> training_sigmas(const std::vector<double>& ac) {
  const auto a = to_f32_tensor(ac);
  return to_vector(((1.0 - a) / a).pow(0.5));
}

std::vector<double> log_sigmas(const std::vector<double>& training_sigmas) {
  std::vector<double> out;
  for (double s : training_sigmas) out.push_back(f32(std::log(s)));
  return out;
}

std::vector<double> spaced_timesteps(Spacing spacing, int T, int n, int steps_offset, bool integer) {
  std::vector<double> t;
  switch (spacing) {
    case Spacing::Linspace:
      for (int k = n - 1; k >= 0; --k) {
        const double v = linspace_at(0, T - 1, n, k);
        t.push_back(integer ? std::nearbyint(v) : f32(v));
      }
      break;
    case Spacing::Leading:
      for (int k = n - 1; k >= 0; --k) t.push_back(static_cast<double>(k) * (T / n) + steps_offset);
      break;
    case Spacing::Trailing:
      t = trailing(T, static_cast<double>(T) / n);
      break;
  }
  return t;
}

std::vector<double> dpm_timesteps(Spacing spacing, int T, int last_timestep, int n, int steps_offset) {
  std::vector<double> t;
  switch (spacing) {
    case Spacing::Linspace:
      for (int k = n; k >= 1; --k) t.push_back(std::nearbyint(linspace_at(0, last_timestep - 1, n + 1, k)));
      break;
    case Spacing::Leading:
      for (int k = n; k >= 1; --k) t.push_back(static_cast<double>(k) * (last_timestep / (n + 1)) + steps_offset);
      break;
    case Spacing::Trailing:
      t = trailing(last_timestep, static_cast<double>(T) / n);
      break;
  }
  return t;
}

int lambda_clipped_last_timestep(const std::vector<double>& ac, double lambda_min_clipped) {
  const auto a = to_f32_tensor(ac);
  const auto lambda = at::log(at::sqrt(a)) - at::log(at::sqrt(1.0 - a));
  const auto clipped = at::searchsorted(at::flip(lambda, {0}), lambda_min_clipped).item<int64_t>();
  return static_cast<int>(static_cast<int64_t>(ac.size()) - clipped);
}

std::vector<double> interpolate_sigmas(const std::vector<double>& sigmas, const std::vector<double>& timesteps) {
  const auto last = static_cast<int64_t>(sigmas.size()) - 1;
  std::vector<double> out;
  for (double t : timesteps) {
    if (t <= 0) {
      out.push_back(sigmas.front());
    } else if (t >= static_cast<double>(last)) {
      out.push_back(sigmas.back());
    } else {
      const auto j = static_cast<int64_t>(std::floor(t));
      const double slope = sigmas[j + 1] - sigmas[j];
      out.push_back(slope * (t - static_cast<double>(j)) + sigmas[j]);
    }
  }
  return out;
}

std::vector<double> karras_sigmas(double sigma_min, double sigma_max, int n, double rho) {
  const double min_inv_rho = std::pow(sigma_min, 1 / rho), max_inv_rho = std::pow(sigma_max, 1 / rho);
  std::vector<double> out;
  for (int k = 0; k < n; ++k)
    out.push_back(std::pow(max_inv_rho + linspace_at(0, 1, n, k) * (min_inv_rho - max_inv_rho), rho));
  return out;
}

double flow_shift(double sigma, double shift) { return shift * sigma / (1 + (shift - 1) * sigma); }

std::vector<double> flow_match_sigmas(int T, int n, double shift) {
  // The training schedule's ends, shifted in float32 tensors as the scheduler's constructor does.
  auto ends = at::tensor({static_cast<float>(T), 1.0f}) / T;
  ends = shift * ends / (1 + (shift - 1) * ends);
  const auto e = to_vector(ends);
  std::vector<double> out;
  for (int k = 0; k < n; ++k) out.push_back(f32(flow_shift(linspace_at(e[0] * T, e[1] * T, n, k) / T, shift)));
  return out;
}

std::vector<double> flow_match_sigmas(int T, int n, double shift, const std::optional<FlowTimeShift>& time_shift,
                                      bool linear_sigmas) {
  if (!time_shift && !linear_sigmas) return flow_match_sigmas(T, n, shift);
  std::vector<double> base;
  for (int k = 0; k < n; ++k)
    base.push_back(linear_sigmas ? f32(linspace_at(1.0, 1.0 / n, n, k)) : linspace_at(T, f32(1.0 / T) * T, n, k) / T);
  // numpy's float32 arithmetic (a Python float operand is converted to float32 first) or float64.
  const auto r = [linear_sigmas](double x) { return linear_sigmas ? f32(x) : x; };
  std::vector<double> out;
  for (double s : base) {
    double v;
    if (time_shift) {
      const double a = r(time_shift->linear ? time_shift->mu : std::exp(time_shift->mu));
      v = r(a / r(a + r(r(1.0 / s) - 1.0)));
    } else {
      v = r(r(shift * s) / r(1.0 + r(r(shift - 1.0) * s)));
    }
    out.push_back(f32(v));
  }
  return out;
}

double sigma_to_t(double sigma, const std::vector<double>& log_sigmas) {
  const double log_sigma = std::log(std::max(sigma, 1e-10));
  const auto size = static_cast<int64_t>(log_sigmas.size());
  int64_t low = 0;
  for (int64_t i = 0; i < size; ++i)
    if (log_sigma - log_sigmas[i] >= 0) low = i;
  low = std::min(low, size - 2);
  const double lo = log_sigmas[low], hi = log_sigmas[low + 1];
  // The denominator is a difference of two float32 values, rounded to float32 as numpy does.
  const double w = std::clamp((lo - log_sigma) / f32(lo - hi), 0.0, 1.0);
  return (1 - w) * static_cast<double>(low) + w * static_cast<double>(low + 1);
}

}  // namespace diffract::schedulers
