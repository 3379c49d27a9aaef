#pragma once
// UNet2DConditionModel::forward replayed from CUDA graphs, one per input shape.
//
// A step of SDXL at batch 2 launches ~1,700 kernels; eager, the host cannot issue them as fast
// as the GPU runs them. A graph issues them in one call. Each new (rows, latent size, tokens,
// dtype) is captured the first time it is seen (two eager warm-up calls for cuDNN's plans, then
// the capture; a few hundred ms), with static input buffers the later calls copy into. The
// cache keeps the most recently used `max_graphs` shapes; each holds its own memory pool.
//
// The stage calls the multi-GPU strategies make (AsyncDiff's forward_range, hybrid CFG's U
// split) are replayed likewise, from a second cache (GraphCache, graphed_function.h) keyed by
// the call (layer range or split), its input shapes and dtype, and the memory format. Their time
// embedding is made inside the graph from a device timestep tensor, as forward() does, so one
// graph serves every step. Each stage call returns tensors of its own (copies of the graph's
// outputs: AsyncDiff sends its state to a peer while the next replay may already run), except
// skips a layer range passes through untouched, which come back as the caller's tensors.
// Under a patch context (DistriFusion's bands) the stage calls are graphed only when the context
// says its hooks touch nothing but its fixed buffers (PatchContext::graph_tag(), part of the key).
// Captures belong outside the strategies' loops (Strategy::warm / warm_rank): a capture's eager
// warm-up (cuDNN autotuning, cudaFree) while a peer waits in NCCL hangs the ranks.
#include <cstdint>
#include <memory>
#include <utility>

#include "core/models/unets/unet_2d_condition.h"
#include "core/util/graphed_function.h"

namespace diffract::models {

struct UNetGraphOptions {
  bool enabled = true;  // false: always eager
  int max_graphs = 3;
  // Weights and activations channels-last (NHWC) inside; inputs and outputs stay as given.
  // Faster for some models on some GPUs, slower for others: the pipeline measures (tune()).
  bool channels_last = false;
  // The stage calls (forward_range, forward_outer_down / inner / outer_up) from CUDA graphs too,
  // keeping up to max_stage_graphs (call, shapes) keys: AsyncDiff's rank needs 1, hybrid CFG's 3.
  // DIFFRACT_STAGE_GRAPHS=0 turns them off (stage_graphs_from_env()), DIFFRACT_CUDA_GRAPHS=0 all.
  bool stage_graphs = true;
  int max_stage_graphs = 4;
};

// false when DIFFRACT_STAGE_GRAPHS is "0", else true.
bool stage_graphs_from_env();

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
  // graphed per (call, split, shapes) when stage graphs are on (see above).
  UNetOuterState forward_outer_down(const at::Tensor& sample, const at::Tensor& timesteps, const UNetConditioning& cond,
                                    int split);
  at::Tensor forward_inner(const at::Tensor& h, const at::Tensor& timesteps, const UNetConditioning& cond, int split);
  at::Tensor forward_outer_up(UNetOuterState state, const at::Tensor& inner, const UNetConditioning& cond, int split);

  // AsyncDiff's sequential layers (UNet2DConditionModelImpl::forward_range etc.). stage_begin
  // and embed_time run eagerly; forward_range is graphed per (begin, end, shapes).
  UNetStageState stage_begin(const at::Tensor& sample, const at::Tensor& timesteps, const UNetConditioning& cond) {
    return unet_->stage_begin(sample, timesteps, cond);
  }
  // Layers [begin, end) on the state with its temb (an input of the graph).
  void forward_range(UNetStageState& state, int begin, int end, const UNetConditioning& cond);
  // Layers [begin, end) at `timesteps` ([B] float, on the state's device): state.temb becomes
  // embed_time(timesteps, cond, h's dtype), made inside the graph, then the layers run.
  void forward_range(UNetStageState& state, int begin, int end, const at::Tensor& timesteps,
                     const UNetConditioning& cond);
  at::Tensor embed_time(const at::Tensor& timesteps, const UNetConditioning& cond, c10::ScalarType dtype) {
    return unet_->embed_time(timesteps, cond, dtype);
  }

  const UNet2DConditionModel& unet() const { return unet_; }
  const UNetGraphOptions& options() const { return options_; }
  // Switches the memory format (converts the weights in place, drops the graphs).
  void set_channels_last(bool on);
  int graphs() const;               // forward()'s graphs
  int stage_graphs() const;         // the stage calls' graphs
  CaptureStats last_capture() const;  // forward()'s last capture (all 0 until one happened)
  void set_stage_graphs(bool on);   // off: the stage calls run eagerly (drops their graphs)
  void clear();                     // drops every graph (forward()'s and the stages') and its memory

 private:
  struct Cache;
  UNet2DConditionModel unet_;
  UNetGraphOptions options_;
  std::unique_ptr<Cache> cache_;
  GraphCache stages_;
  bool stage_graphed(const at::Tensor& x) const;
  // The 4-D inputs' memory format inside the graphs (the weights').
  at::MemoryFormat layout() const;
};

}  // namespace diffract::models
