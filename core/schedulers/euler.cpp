// Euler and Euler ancestral (Karras et al. 2022, k-diffusion): the ODE / SDE in sigma space,
// x = x0 + sigma * eps, as diffusers' EulerDiscreteScheduler and EulerAncestralDiscreteScheduler.
#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "core/schedulers/detail.h"
#include "core/schedulers/schedule.h"

namespace diffract::schedulers {

namespace {

class EulerSampler final : public Sampler {
 public:
  EulerSampler(SamplerKind kind, const SchedulerConfig& c, int n) : Sampler(kind, c) {
    const bool ancestral = kind == SamplerKind::EulerAncestral;
    const auto train = training_sigmas(detail::sigma_space_alphas_cumprod(c));
    timesteps_ = spaced_timesteps(c.timestep_spacing, c.num_train_timesteps, n, c.steps_offset, false);
    sigmas_ = interpolate_sigmas(train, timesteps_);
    if (!ancestral && c.use_karras_sigmas) {
      const auto logs = log_sigmas(train);
      sigmas_ = karras_sigmas(c.sigma_min.value_or(sigmas_.back()), c.sigma_max.value_or(sigmas_.front()), n);
      for (size_t i = 0; i < sigmas_.size(); ++i) timesteps_[i] = f32(sigma_to_t(sigmas_[i], logs));
    }
    sigmas_.push_back(!ancestral && c.final_sigmas_type == "sigma_min" ? train.front() : 0.0);
    for (auto& s : sigmas_) s = f32(s);
    const double max_sigma = *std::max_element(sigmas_.begin(), sigmas_.end());
    // diffusers' choice: sqrt(sigma_max^2 + 1), the std of x0 + sigma * eps for unit-variance x0,
    // with leading spacing only.
    init_noise_sigma_ = c.timestep_spacing == Spacing::Leading ? f32(std::sqrt(max_sigma * max_sigma + 1)) : max_sigma;
  }

  at::Tensor scale_model_input(const at::Tensor& sample, int i) const override {
    check_step(i);
    return sample / std::sqrt(sigmas_[i] * sigmas_[i] + 1);
  }

  at::Tensor add_noise(const at::Tensor& x0, const at::Tensor& noise, int i) const override {
    check_level(i);
    return (x0.to(at::kFloat) + noise.to(at::kFloat) * sigmas_[i]).to(x0.scalar_type());
  }

  at::Tensor predict_x0(const at::Tensor& model_output, int i, const at::Tensor& sample) const override {
    check_step(i);
    return x0(model_output, sigmas_[i], sample.to(at::kFloat));
  }

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
  at::Tensor x0(const at::Tensor& model_output, double sigma, const at::Tensor& x) const {
    if (config_.prediction_type == Prediction::Epsilon) return x - sigma * model_output;
    return model_output * (-sigma / std::sqrt(sigma * sigma + 1)) + x / (sigma * sigma + 1);
  }

  at::Tensor transition(const at::Tensor& model_output, int i, int j, const at::Tensor& sample,
                        const at::Generator& generator) const {
    const double sigma = sigmas_[i], sigma_to = sigmas_[j];
    const auto x = sample.to(at::kFloat);
    const auto derivative = (x - x0(model_output, sigma, x)) / sigma;
    if (kind_ == SamplerKind::Euler) return (x + derivative * (sigma_to - sigma)).to(model_output.scalar_type());
    // Ancestral: step down to sigma_down deterministically, then add fresh noise of sigma_up.
    const double sigma_up =
        std::sqrt(sigma_to * sigma_to * (sigma * sigma - sigma_to * sigma_to) / (sigma * sigma));
    const double sigma_down = std::sqrt(std::max(0.0, sigma_to * sigma_to - sigma_up * sigma_up));
    const auto prev = x + derivative * (sigma_down - sigma);
    const auto noise = detail::noise_like(model_output, generator);
    return (prev + noise * sigma_up).to(model_output.scalar_type());
  }
};

}  // namespace

std::unique_ptr<Sampler> detail::make_euler(SamplerKind kind, const SchedulerConfig& config, int n) {
  return std::make_unique<EulerSampler>(kind, config, n);
}

}  // namespace diffract::schedulers
