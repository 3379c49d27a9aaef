#pragma once
#include "core/parallel/strategy.h"

namespace diffract::parallel {

// Naive baseline at a given speed-up: one device, evaluate every `skip`-th step and jump over
// the others (jump(i, i + skip)); ceil(steps / skip) rounds.
struct StepSkipping final : Strategy {
  int skip = 2;
  std::string name() const override { return "step-skip"; }
  int devices() const override { return 1; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
};

}  // namespace diffract::parallel
