#pragma once
#include "core/parallel/strategy.h"

namespace diffract::parallel {

// Conditional branch on rank 0, unconditional on rank 1, one all_gather per step. Exact
// (up to batch-1 vs batch-2 rounding). Records rel-MAE per step.
struct CfgParallel final : Strategy {
  std::string name() const override { return "cfg-parallel"; }
  int devices() const override { return 2; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
  void warm(Denoiser& d, const at::Tensor& x, double timestep) const override;
};

}  // namespace diffract::parallel
