#pragma once
// First-Block Cache (ParaAttention's FBCache; xDiT and cache-dit ship it too) for the SD3 and Flux
// transformers: an approximate strategy of the evaluation level on one device. Every step runs the
// transformer's first block; when its image residual (output minus input) has moved less than
// `threshold` (mean |now - then| / mean |then|, over the whole CFG batch) since the last step that
// ran every block, the other blocks are skipped and the residual they gave then is added instead
// (models::FirstBlockCache). Threshold 0 never reuses: the plain loop's result. The stats list the
// steps that reused (LoopStats::reused_steps). Composes with nothing yet: one device.
#include <cstdint>
#include <string>

#include "core/parallel/strategy.h"

namespace diffract::parallel {

struct FirstBlockCaching final : Strategy {
  double threshold = 0.12;

  std::string name() const override { return "fbcache"; }
  int devices() const override { return 1; }
  void validate(std::int64_t batch, bool cfg) const override;
  LoopOutput run(DeviceGroup& group, const LoopInputs& in) const override;
};

}  // namespace diffract::parallel
