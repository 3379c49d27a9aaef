#pragma once
// Flow matching (rectified flow, SD3): x_sigma = (1 - sigma) * x0 + sigma * noise, and the
// denoiser predicts the velocity v = noise - x0. The ODE is linear in sigma along v, so an
// Euler step and a jump are the same transition; DRiffusion's drafts use it through
// Sampler::jump, and these plain functions are what the sampler calls.
#include <ATen/core/Tensor.h>

namespace diffract::schedulers {

// From state x at sigma_from with velocity v to sigma_to: x + (sigma_to - sigma_from) * v, in
// float32 (half inputs upcast) with the difference of the two float32 sigmas rounded to float32,
// as diffusers' FlowMatchEulerDiscreteScheduler.step; returns velocity's dtype.
at::Tensor flow_match_transition(const at::Tensor& sample, const at::Tensor& velocity, double sigma_from,
                                 double sigma_to);
// The x0 estimate at sigma: x - sigma * v (float32).
at::Tensor flow_match_x0(const at::Tensor& sample, const at::Tensor& velocity, double sigma);

}  // namespace diffract::schedulers
