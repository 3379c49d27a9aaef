// Flow-matching Euler, as diffusers' FlowMatchEulerDiscreteScheduler (static or
// resolution-dependent shift, deterministic).
#include "core/schedulers/flow_match.h"

#include <ATen/ATen.h>

#include "core/schedulers/detail.h"
#include "core/schedulers/schedule.h"
#include "core/util/error.h"

namespace diffract::schedulers {

at::Tensor flow_match_transition(const at::Tensor& sample, const at::Tensor& velocity, double sigma_from,
                                 double sigma_to) {
  const double dt = f32(f32(sigma_to) - f32(sigma_from));
  return (sample.to(at::kFloat) + dt * detail::upcast(velocity)).to(velocity.scalar_type());
}

at::Tensor flow_match_x0(const at::Tensor& sample, const at::Tensor& velocity, double sigma) {
  return sample.to(at::kFloat) - f32(sigma) * detail::upcast(velocity);
}

namespace {

class FlowMatchEulerSampler final : public Sampler {
 public:
  FlowMatchEulerSampler(const SchedulerConfig& c, int n) : Sampler(SamplerKind::FlowMatchEuler, c) {
    std::optional<FlowTimeShift> time_shift;
    if (c.use_dynamic_shifting) {
      if (!c.mu) throw Error("flow-euler sampler: the scheduler shifts by resolution (use_dynamic_shifting), but the "
                             "pipeline gave no mu for the image's size");
      time_shift = FlowTimeShift{*c.mu, c.time_shift_type == "linear"};
    }
    sigmas_ = flow_match_sigmas(c.num_train_timesteps, n, c.shift, time_shift, c.linear_sigmas);
    for (double s : sigmas_) timesteps_.push_back(f32(s * c.num_train_timesteps));
    sigmas_.push_back(0.0);
    init_noise_sigma_ = 1.0;
  }

  at::Tensor predict_x0(const at::Tensor& model_output, int i, const at::Tensor& sample) const override {
    check_step(i);
    return flow_match_x0(sample, model_output, sigmas_[i]);
  }

  at::Tensor add_noise(const at::Tensor& x0, const at::Tensor& noise, int i) const override {
    check_level(i);
    const double s = f32(sigmas_[i]);
    return (s * noise.to(at::kFloat) + f32(1.0 - s) * x0.to(at::kFloat)).to(x0.scalar_type());
  }

  at::Tensor step(const at::Tensor& model_output, int i, const at::Tensor& sample, at::Generator) override {
    check_step(i);
    return flow_match_transition(sample, model_output, sigmas_[i], sigmas_[i + 1]);
  }

  at::Tensor jump(const at::Tensor& model_output, int i, int j, const at::Tensor& sample,
                  at::Generator) const override {
    check_jump(i, j);
    return flow_match_transition(sample, model_output, sigmas_[i], sigmas_[j]);
  }
};

}  // namespace

std::unique_ptr<Sampler> detail::make_flow_match_euler(const SchedulerConfig& config, int n) {
  return std::make_unique<FlowMatchEulerSampler>(config, n);
}

}  // namespace diffract::schedulers
