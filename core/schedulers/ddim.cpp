// DDIM (Song et al. 2021, eta 0) and DDPM (Ho et al. 2020): samplers over alphas_cumprod at
// integer training timesteps, as diffusers' DDIMScheduler and DDPMScheduler.
#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "core/schedulers/detail.h"
#include "core/schedulers/schedule.h"

namespace diffract::schedulers {

namespace {

class AlphaSampler : public Sampler {
 public:
  at::Tensor predict_x0(const at::Tensor& model_output, int i, const at::Tensor& sample) const override {
    check_step(i);
    return predict(detail::upcast(model_output), alpha(i), detail::upcast(sample)).first;
  }

  at::Tensor add_noise(const at::Tensor& x0, const at::Tensor& noise, int i) const override {
    check_level(i);
    if (i == num_steps()) return x0;
    const double a = f32(alpha(i));
    return (f32(std::sqrt(a)) * x0.to(at::kFloat) + f32(std::sqrt(f32(1 - a))) * noise.to(at::kFloat))
        .to(x0.scalar_type());
  }

 protected:
  AlphaSampler(SamplerKind kind, const SchedulerConfig& c, int n) : Sampler(kind, c), ac_(alphas_cumprod(c)) {
    timesteps_ = spaced_timesteps(c.timestep_spacing, c.num_train_timesteps, n, c.steps_offset, true);
    detail::check_timesteps_in_range(timesteps_, c, kind);
  }

  double alpha_of_timestep(double t) const { return ac_[static_cast<size_t>(t)]; }
  double alpha(int i) const { return alpha_of_timestep(timesteps_[i]); }

  // (x0, eps) predicted at alphas_cumprod a; x0 clipped when the config asks.
  std::pair<at::Tensor, at::Tensor> predict(const at::Tensor& m, double a, const at::Tensor& x) const {
    const double sqrt_a = std::sqrt(a), sqrt_b = std::sqrt(f32(1 - a));
    at::Tensor x0, eps;
    if (config_.prediction_type == Prediction::Epsilon) {
      x0 = (x - sqrt_b * m) / sqrt_a;
      eps = m;
    } else {
      x0 = sqrt_a * x - sqrt_b * m;
      eps = sqrt_a * m + sqrt_b * x;
    }
    if (config_.clip_sample) x0 = x0.clamp(-config_.clip_sample_range, config_.clip_sample_range);
    return {x0, eps};
  }

  std::vector<double> ac_;
};

class DDIMSampler final : public AlphaSampler {
 public:
  DDIMSampler(const SchedulerConfig& c, int n)
      : AlphaSampler(SamplerKind::DDIM, c, n),
        step_ratio_(c.num_train_timesteps / n),
        final_alpha_(c.set_alpha_to_one ? 1.0 : ac_.front()) {}

  at::Tensor step(const at::Tensor& model_output, int i, const at::Tensor& sample, at::Generator) override {
    check_step(i);
    return transition(model_output, i, landing_alpha(i), sample);
  }

  at::Tensor jump(const at::Tensor& model_output, int i, int j, const at::Tensor& sample,
                  at::Generator) const override {
    check_jump(i, j);
    return transition(model_output, i, landing_alpha(j - 1), sample);
  }

 private:
  // Where step i lands: diffusers steps back by T // n from the current timestep (which is the
  // next timestep for leading and trailing spacing), and to final_alpha past 0.
  double landing_alpha(int i) const {
    const double prev = timesteps_[i] - step_ratio_;
    return prev >= 0 ? alpha_of_timestep(prev) : final_alpha_;
  }

  at::Tensor transition(const at::Tensor& model_output, int i, double alpha_to, const at::Tensor& sample) const {
    const auto [x0, eps] = predict(detail::upcast(model_output), alpha(i), detail::upcast(sample));
    return (std::sqrt(alpha_to) * x0 + std::sqrt(f32(1 - alpha_to)) * eps).to(model_output.scalar_type());
  }

  int step_ratio_;
  double final_alpha_;
};

class DDPMSampler final : public AlphaSampler {
 public:
  DDPMSampler(const SchedulerConfig& c, int n) : AlphaSampler(SamplerKind::DDPM, c, n) {}

  at::Tensor step(const at::Tensor& model_output, int i, const at::Tensor& sample, at::Generator generator) override {
    check_step(i);
    return transition(model_output, i, i + 1, sample, generator);
  }

  at::Tensor jump(const at::Tensor& model_output, int i, int j, const at::Tensor& sample,
                  at::Generator generator) const override {
    check_jump(i, j);
    return transition(model_output, i, j, sample, generator);
  }

 private:
  // A draw from the posterior q(x_j | x_i, x0) of the forward process, x0 predicted at step i.
  at::Tensor transition(const at::Tensor& model_output, int i, int j, const at::Tensor& sample,
                        const at::Generator& generator) const {
    const double a = alpha(i), a_prev = j < num_steps() ? alpha(j) : 1.0;
    const double b = f32(1 - a), b_prev = f32(1 - a_prev);
    const double cur_alpha = f32(a / a_prev), cur_beta = f32(1 - cur_alpha);
    const auto x = detail::upcast(sample);
    const auto x0 = predict(detail::upcast(model_output), a, x).first;
    auto prev = (std::sqrt(a_prev) * cur_beta / b) * x0 + (std::sqrt(cur_alpha) * b_prev / b) * x;
    if (timesteps_[i] > 0) {
      const auto noise = detail::noise_like(model_output, generator);
      const double variance = std::max(f32(b_prev / b) * cur_beta, 1e-20);
      double std_dev = std::sqrt(variance);
      if (config_.variance_type == "fixed_small_log") std_dev = std::exp(0.5 * std::log(variance));
      else if (config_.variance_type == "fixed_large") std_dev = std::sqrt(cur_beta);
      prev = prev + std_dev * noise;
    }
    return prev.to(model_output.scalar_type());
  }
};

}  // namespace

std::unique_ptr<Sampler> detail::make_ddim(const SchedulerConfig& config, int n) {
  return std::make_unique<DDIMSampler>(config, n);
}

std::unique_ptr<Sampler> detail::make_ddpm(const SchedulerConfig& config, int n) {
  return std::make_unique<DDPMSampler>(config, n);
}

}  // namespace diffract::schedulers
