#pragma once
// Shared by the sampler implementations; not part of the public API.
#include <memory>

#include <ATen/core/Tensor.h>

#include "core/schedulers/sampler.h"

namespace diffract::schedulers::detail {

std::unique_ptr<Sampler> make_euler(SamplerKind kind, const SchedulerConfig& config, int n);  // and ancestral
std::unique_ptr<Sampler> make_ddim(const SchedulerConfig& config, int n);
std::unique_ptr<Sampler> make_ddpm(const SchedulerConfig& config, int n);
std::unique_ptr<Sampler> make_dpm_solver(SamplerKind kind, const SchedulerConfig& config, int n);
std::unique_ptr<Sampler> make_flow_match_euler(const SchedulerConfig& config, int n);

// Half and bfloat16 tensors as float32; others unchanged.
at::Tensor upcast(const at::Tensor& t);
// Standard normal noise shaped and typed like `like`, drawn as diffusers' randn_tensor does.
at::Tensor noise_like(const at::Tensor& like, const at::Generator& generator);
// Alphas_cumprod of the config with the zero-SNR terminal value clamped to 2^-24, as diffusers'
// sigma-space schedulers do (an infinite sigma would break them).
std::vector<double> sigma_space_alphas_cumprod(const SchedulerConfig& config);
// Throws unless every timestep indexes the training schedule (DDIM and DDPM index it directly).
void check_timesteps_in_range(const std::vector<double>& timesteps, const SchedulerConfig& config, SamplerKind kind);

}  // namespace diffract::schedulers::detail
