// DPM-Solver++(2M) (Lu et al. 2022): multistep, data prediction, in log-SNR time, as diffusers'
// DPMSolverMultistepScheduler with algorithm_type dpmsolver++ and solver_order 2.
#include <cmath>
#include <optional>

#include <ATen/ATen.h>

#include "core/schedulers/detail.h"
#include "core/schedulers/schedule.h"
#include "core/util/error.h"

namespace diffract::schedulers {

namespace {

// A noise level sigma (of x / alpha) as the VP process sees it: x = alpha * x0 + sigma_t * eps,
// with log-SNR lambda = log(alpha / sigma_t).
struct Level {
  double alpha, sigma_t, lambda;
  explicit Level(double sigma)
      : alpha(1 / std::sqrt(sigma * sigma + 1)), sigma_t(sigma * alpha), lambda(-std::log(sigma)) {}
};

class DPMSolverSampler final : public Sampler {
 public:
  DPMSolverSampler(SamplerKind kind, const SchedulerConfig& c, int n) : Sampler(kind, c) {
    const auto ac = detail::sigma_space_alphas_cumprod(c);
    const auto train = training_sigmas(ac);
    if (c.use_karras_sigmas) {
      const auto logs = log_sigmas(train);
      sigmas_ = karras_sigmas(c.sigma_min.value_or(train.front()), c.sigma_max.value_or(train.back()), n);
      // diffusers rounds the timesteps except for the cosine schedule, where it truncates.
      const bool round = c.beta_schedule != "squaredcos_cap_v2";
      for (double s : sigmas_) {
        const double t = sigma_to_t(s, logs);
        timesteps_.push_back(round ? std::nearbyint(t) : std::trunc(t));
      }
    } else {
      const int last = lambda_clipped_last_timestep(ac, c.lambda_min_clipped);
      timesteps_ = dpm_timesteps(c.timestep_spacing, c.num_train_timesteps, last, n, c.steps_offset);
      if (timesteps_.empty())
        throw Error(std::string(sampler_name(kind)) + " sampler: lambda_min_clipped " +
                    std::to_string(c.lambda_min_clipped) + " leaves no timesteps");
      sigmas_ = interpolate_sigmas(train, timesteps_);
    }
    sigmas_.push_back(c.final_sigmas_type == "sigma_min" ? train.front() : 0.0);
    for (auto& s : sigmas_) s = f32(s);
  }

  at::Tensor predict_x0(const at::Tensor& model_output, int i, const at::Tensor& sample) const override {
    check_step(i);
    return x0(detail::upcast(model_output), i, detail::upcast(sample));
  }

  at::Tensor step(const at::Tensor& model_output, int i, const at::Tensor& sample, at::Generator) override {
    check_step(i);
    const auto m = x0(detail::upcast(model_output), i, detail::upcast(sample));
    const auto x = sample.to(at::kFloat);
    const int n = num_steps();
    const bool final_first_order =
        i == n - 1 && (config_.euler_at_final || (config_.lower_order_final && n < 15) ||
                       config_.final_sigmas_type == "zero");
    const bool history = previous_ && previous_->first == i - 1;
    const auto out = history && !final_first_order ? second_order(m, previous_->second, i, x)
                                                   : first_order(m, sigmas_[i], sigmas_[i + 1], x);
    previous_ = {i, m};
    return out.to(model_output.scalar_type());
  }

  at::Tensor add_noise(const at::Tensor& x0, const at::Tensor& noise, int i) const override {
    check_level(i);
    if (i == num_steps()) return x0;
    const Level s(sigmas_[i]);
    return (f32(s.alpha) * x0.to(at::kFloat) + f32(s.sigma_t) * noise.to(at::kFloat)).to(x0.scalar_type());
  }

  at::Tensor jump(const at::Tensor& model_output, int i, int j, const at::Tensor& sample,
                  at::Generator) const override {
    check_jump(i, j);
    const auto m = x0(detail::upcast(model_output), i, detail::upcast(sample));
    return first_order(m, sigmas_[i], sigmas_[j], sample.to(at::kFloat)).to(model_output.scalar_type());
  }

  void reset() override { previous_.reset(); }

 private:
  at::Tensor x0(const at::Tensor& m, int i, const at::Tensor& x) const {
    const Level s(sigmas_[i]);
    if (config_.prediction_type == Prediction::Epsilon) return (x - s.sigma_t * m) / s.alpha;
    return s.alpha * x - s.sigma_t * m;
  }

  // DPM-Solver++ first order (DDIM in data prediction); at sigma 0 it returns x0.
  static at::Tensor first_order(const at::Tensor& x0, double sigma_from, double sigma_to, const at::Tensor& x) {
    const Level s(sigma_from), t(sigma_to);
    const double h = t.lambda - s.lambda;
    return (t.sigma_t / s.sigma_t) * x - (t.alpha * std::expm1(-h)) * x0;
  }

  at::Tensor second_order(const at::Tensor& m0, const at::Tensor& m1, int i, const at::Tensor& x) const {
    const Level t(sigmas_[i + 1]), s0(sigmas_[i]), s1(sigmas_[i - 1]);
    const double h = t.lambda - s0.lambda, h0 = s0.lambda - s1.lambda;
    const double phi = t.alpha * std::expm1(-h);
    const auto d1 = (h / h0) * (m0 - m1);
    const auto base = (t.sigma_t / s0.sigma_t) * x - phi * m0;
    if (config_.solver_type == "heun") return base + (t.alpha * (std::expm1(-h) / h + 1)) * d1;
    return base - (0.5 * phi) * d1;
  }

  std::optional<std::pair<int, at::Tensor>> previous_;  // the last step's index and x0 prediction
};

}  // namespace

std::unique_ptr<Sampler> detail::make_dpm_solver(SamplerKind kind, const SchedulerConfig& config, int n) {
  return std::make_unique<DPMSolverSampler>(kind, config, n);
}

}  // namespace diffract::schedulers
