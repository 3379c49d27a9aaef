#pragma once
// First-Block Cache (ParaAttention's FBCache, also in xDiT and cache-dit): a transformer runs its
// first block every step, and the others only when the first block's residual has moved more
// than a threshold since the last step that ran them all; otherwise it adds the residual the other
// blocks gave then. The state a denoising loop keeps between steps (one per CFG batch layout).
#include <ATen/core/Tensor.h>

namespace diffract::models {

struct FirstBlockCache {
  double threshold = 0;  // relative mean |change| of the first block's residual; 0: never reuse
  at::Tensor first_residual;  // the first block's output minus its input, at the last full step
  at::Tensor rest_residual;   // the other blocks' output minus their input, at that step
  bool reused = false;        // the last call reused rest_residual
  // Whether the first block's residual `now` is close enough to the last full step's to reuse
  // the rest: mean |now - then| / mean |then| < threshold (one decision for the whole batch).
  bool can_reuse(const at::Tensor& now) const;
};

}  // namespace diffract::models
