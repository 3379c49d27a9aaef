#pragma once
// A function of tensors replayed from CUDA graphs, one per set of input shapes and dtypes, as
// UNetGraphRunner does for the UNet (unet_graphs.h): the first call for a shape runs it eagerly
// twice (cuDNN's plans, workspaces) and captures it; later calls copy into the static inputs and
// replay. SD3's transformer step uses it. (Graphing the TAESD preview decode was measured and
// did not pay: SD 1.5's previews cost +10.4 % graphed against +10.1 % eager, docs/benchmarks.md.)
// Eager on the CPU and when disabled.
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

namespace diffract {

class GraphedFunction {
 public:
  using Function = std::function<at::Tensor(const std::vector<at::Tensor>&)>;
  // `f` must be capturable: no host synchronisation, no CPU tensors, same work for a given shape.
  explicit GraphedFunction(Function f, int max_graphs = 2);
  // A function of one tensor.
  explicit GraphedFunction(std::function<at::Tensor(const at::Tensor&)> f, int max_graphs = 2);
  ~GraphedFunction();
  GraphedFunction(const GraphedFunction&) = delete;
  GraphedFunction& operator=(const GraphedFunction&) = delete;

  // f(inputs) as a tensor of its own (a copy of the graph's output), on the current stream.
  // Every input must be a defined tensor on the same device.
  at::Tensor operator()(const std::vector<at::Tensor>& inputs);
  at::Tensor operator()(const at::Tensor& x) { return (*this)(std::vector<at::Tensor>{x}); }
  void set_enabled(bool on);
  bool enabled() const { return enabled_; }
  int graphs() const;
  void clear();  // drops every graph and its memory

 private:
  struct Cache;
  Function f_;
  int max_graphs_;
  bool enabled_ = true;
  std::unique_ptr<Cache> cache_;
};

}  // namespace diffract
