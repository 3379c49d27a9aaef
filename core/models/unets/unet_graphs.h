#pragma once
// UNet2DConditionModel::forward replayed from CUDA graphs, one per input shape.
//
// A step of SDXL at batch 2 launches ~1,700 kernels; eager, the host cannot issue them as fast
// as the H200 runs them. A graph issues them in one call. Each new (rows, latent size, tokens,
// dtype) is captured the first time it is seen (two eager warm-up calls for cuDNN's plans, then
// the capture; a few hundred ms), with static input buffers the later calls copy into. The
// cache keeps the most recently used `max_graphs` shapes; each holds its own memory pool.
#include <cstdint>
#include <memory>
#include <utility>

#include "core/models/unets/unet_2d_condition.h"

namespace diffract::models {

struct UNetGraphOptions {
  bool enabled = true;  // false: always eager
  int max_graphs = 3;
  // Weights and activations channels-last (NHWC) inside; inputs and outputs stay as given.
  // Faster for some models on some GPUs, slower for others: the pipeline measures (tune()).
  bool channels_last = false;
};

class UNetGraphRunner {
 public:
  explicit UNetGraphRunner(UNet2DConditionModel unet, UNetGraphOptions options = {});
  ~UNetGraphRunner();
  UNetGraphRunner(const UNetGraphRunner&) = delete;
  UNetGraphRunner& operator=(const UNetGraphRunner&) = delete;

  // sample [B, C, h, w], timesteps [B] (float), cond with B rows -> [B, C_out, h, w], a tensor
  // of its own (not the graph's buffer). Eager on the CPU and when graphs are off.
  at::Tensor forward(const at::Tensor& sample, const at::Tensor& timesteps, const UNetConditioning& cond);

  // The "U split" stages (UNet2DConditionModelImpl::forward_outer_down etc., same shapes),
  // always eager: hybrid CFG runs them for a few window steps only.
  UNetOuterState forward_outer_down(const at::Tensor& sample, const at::Tensor& timesteps, const UNetConditioning& cond,
                                    int split) {
    return unet_->forward_outer_down(sample, timesteps, cond, split);
  }
  at::Tensor forward_inner(const at::Tensor& h, const at::Tensor& timesteps, const UNetConditioning& cond, int split) {
    return unet_->forward_inner(h, timesteps, cond, split);
  }
  at::Tensor forward_outer_up(UNetOuterState state, const at::Tensor& inner, const UNetConditioning& cond, int split) {
    return unet_->forward_outer_up(std::move(state), inner, cond, split);
  }

  // AsyncDiff's sequential layers (UNet2DConditionModelImpl::forward_range etc.), always eager:
  // a stage's shapes change with its split, and the stages are short.
  UNetStageState stage_begin(const at::Tensor& sample, const at::Tensor& timesteps, const UNetConditioning& cond) {
    return unet_->stage_begin(sample, timesteps, cond);
  }
  void forward_range(UNetStageState& state, int begin, int end, const UNetConditioning& cond) {
    unet_->forward_range(state, begin, end, cond);
  }
  at::Tensor embed_time(const at::Tensor& timesteps, const UNetConditioning& cond, c10::ScalarType dtype) {
    return unet_->embed_time(timesteps, cond, dtype);
  }

  const UNet2DConditionModel& unet() const { return unet_; }
  const UNetGraphOptions& options() const { return options_; }
  // Switches the memory format (converts the weights in place, drops the graphs).
  void set_channels_last(bool on);
  int graphs() const;
  double last_capture_ms() const;  // 0 until a capture happened
  void clear();                    // drops every graph and its memory

 private:
  struct Cache;
  UNet2DConditionModel unet_;
  UNetGraphOptions options_;
  std::unique_ptr<Cache> cache_;
};

}  // namespace diffract::models
