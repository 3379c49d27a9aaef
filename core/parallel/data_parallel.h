#pragma once
#include "core/parallel/strategy.h"

namespace diffract::parallel {

// The batch split in contiguous rows over n devices (sizes differ by at most 1); latents
// gathered at the end. Equal to one device for deterministic samplers; stochastic ones (Euler
// ancestral, DDPM) draw their noise per slice, so their images differ.
struct DataParallel final : Strategy {
  int n = 2;
  std::string name() const override { return "data-parallel"; }
  int devices() const override { return n; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
  void warm(Denoiser& d, const at::Tensor& x, double timestep) const override;
};

}  // namespace diffract::parallel
