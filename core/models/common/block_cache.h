#pragma once
// What a model keeps between the passes of a denoising loop.
//  The step caches (one per loop and CFG batch layout; the loop sets step / steps before each
//  evaluation and reads `reused` after it):
//   FirstBlockCache (ParaAttention's FBCache, also in xDiT and cache-dit): a transformer runs its
//    first block every step, and the others only when the first block's residual has moved more
//    than a threshold since the last step that ran them all; otherwise it adds the residual the
//    other blocks gave then.
//   TeaCache (Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video Diffusion
//    Model", ali-vilab/TeaCache): a transformer skips all its blocks, adding their last residual,
//    while the relative change of the first block's timestep-modulated input, rescaled by a
//    polynomial fitted per model and summed over the skipped steps, stays under a threshold.
//   DeepCache (Ma et al., "DeepCache: Accelerating Diffusion Models for Free", horseee/DeepCache):
//    a UNet's shallow path (conv_in, the first `branch` down layers, the up layers that consume
//    their skips, the output) runs every step, the deep rest only on refresh steps; in between
//    the shallow up path takes the deep feature those gave. Refreshed every `interval` steps, or
//    (fbcache on a UNet) when the first down layer's residual (output minus input) moved more
//    than a threshold.
//  ImageKV: one attention's image keys and values for the whole image, which PipeFusion's passes
//   over row patches of the image update and attend over.
#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace diffract::models {

struct StepCache {
  virtual ~StepCache() = default;
  int step = 0;          // this evaluation's step in the loop, 0 for its first
  int steps = 0;         // the loop's steps
  int warmup = 0;        // the loop's first steps that always run in full (the loop sets it)
  bool reused = false;   // this evaluation reused cached work
  double reused_work = 0;  // then: the part of a full evaluation it ran (estimated from the layers' costs)
  // Where the batch is split over devices (the cfg- and dp- caches): adds the other ranks'
  // sums of |now - then| and |then| to this rank's, so that every rank decides on the whole
  // batch's change, as one device does. Unset: this evaluation holds the whole batch.
  std::function<void(double& changed, double& total)> combine;
  // The relative change a decision reads: relative_change() below, over the whole CFG batch.
  double change(const at::Tensor& now, const at::Tensor& then) const;
};

// Relative mean |now - then| / mean |then| over the whole tensor (the CFG batch decides once).
double relative_change(const at::Tensor& now, const at::Tensor& then);

struct FirstBlockCache final : StepCache {
  double threshold = 0;  // relative mean |change| of the first block's residual; 0: never reuse
  at::Tensor first_residual;  // the first block's output minus its input, at the last full step
  at::Tensor rest_residual;   // the other blocks' output minus their input, at that step
  // Whether the first block's residual `now` is close enough to the last full step's to reuse
  // the rest: relative_change(now, then) < threshold, past the warm-up.
  bool can_reuse(const at::Tensor& now) const;
};

struct TeaCache final : StepCache {
  double threshold = 0;  // the accumulated rescaled change that forces a full step; 0: never reuse
  // The rescaling polynomial, highest power first (numpy.poly1d's order): identity() where the
  // model has none published.
  std::vector<double> coefficients = identity();
  double accumulated = 0;  // the rescaled changes summed since the last full step
  at::Tensor previous;     // the modulated input at the last evaluation
  at::Tensor residual;     // the blocks' output minus input (image stream) at the last full step
  // Takes this evaluation's modulated input: whether to reuse `residual`. The loop's first and
  // last step always run in full, as does any step whose change brings the sum to the threshold
  // (which then starts again from 0).
  bool can_reuse(const at::Tensor& modulated);
  static std::vector<double> identity();  // x: the plain relative change (xDiT's default)
  // TeaCache4FLUX's polynomial for Flux.1 (ali-vilab/TeaCache, TeaCache4FLUX/teacache_flux.py).
  static std::vector<double> flux();
};

struct DeepCache final : StepCache {
  int branch = 0;          // down layers in the shallow path (DeepCache's cache_branch_id)
  int interval = 3;        // a full step every interval-th step of the loop, the first included
  double threshold = -1;   // >= 0: a full step instead when the first down layer's residual moved
                           // more than this since the last full step (0: every step)
  at::Tensor deep;         // the hidden state entering the shallow up path, at the last full step
  at::Tensor first;        // the first down layer's residual then (threshold mode)
  double shallow_work = -1;  // the shallow path's part of a full evaluation (estimated on first use)
  // Whether this step runs in full: the first step, a missing cache, else by interval; in
  // threshold mode `first_now` (the first down layer's residual) decides.
  bool full_step(const at::Tensor& first_now = {}) const;
};

// One attention's image-token keys and values for the whole image, [B, N, ...] with the tokens
// in dimension 1 (after the qk norm and rope): PipeFusion's per-block cache. A pass over a patch
// writes the patch's rows and attends over all N rows, the others as the cache last saw them.
struct ImageKV {
  at::Tensor k, v;
  // k, v: the keys and values of image tokens [begin, begin + n). An empty cache takes them
  // whole (then they must be the whole image: begin 0), as does a pass of the cache's size;
  // otherwise they are written into the cache's rows. Either way k and v become the cache's
  // tensors, the whole image's.
  void write(at::Tensor& k, at::Tensor& v, int64_t begin);
};

}  // namespace diffract::models
