#include "core/util/graphed_function.h"

#include <algorithm>
#include <list>
#include <vector>

#include <ATen/ATen.h>

#ifdef DIFFRACT_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace diffract {

struct GraphedFunction::Cache {
#ifdef DIFFRACT_HAS_CUDA
  struct Entry {
    std::vector<std::vector<std::int64_t>> sizes;
    std::vector<at::ScalarType> dtypes;
    at::Device device{at::kCPU};
    std::vector<at::Tensor> inputs;
    at::Tensor out;
    std::unique_ptr<at::cuda::CUDAGraph> graph;
  };
  std::list<Entry> entries;  // most recently used first
#endif
};

GraphedFunction::GraphedFunction(Function f, int max_graphs)
    : f_(std::move(f)), max_graphs_(max_graphs), cache_(std::make_unique<Cache>()) {}

GraphedFunction::GraphedFunction(std::function<at::Tensor(const at::Tensor&)> f, int max_graphs)
    : GraphedFunction([f = std::move(f)](const std::vector<at::Tensor>& in) { return f(in.at(0)); }, max_graphs) {}

GraphedFunction::~GraphedFunction() { clear(); }

void GraphedFunction::set_enabled(bool on) {
  if (!on) clear();
  enabled_ = on;
}

int GraphedFunction::graphs() const {
#ifdef DIFFRACT_HAS_CUDA
  return static_cast<int>(cache_->entries.size());
#else
  return 0;
#endif
}

void GraphedFunction::clear() {
#ifdef DIFFRACT_HAS_CUDA
  // A replay may still be running when its memory pool is handed back.
  for (const auto& e : cache_->entries) c10::cuda::getCurrentCUDAStream(e.device.index()).synchronize();
  cache_->entries.clear();
#endif
}

at::Tensor GraphedFunction::operator()(const std::vector<at::Tensor>& inputs) {
#ifdef DIFFRACT_HAS_CUDA
  if (enabled_ && max_graphs_ > 0 && !inputs.empty() && inputs.front().is_cuda()) {
    auto& entries = cache_->entries;
    const auto device = inputs.front().device();
    std::vector<std::vector<std::int64_t>> sizes;
    std::vector<at::ScalarType> dtypes;
    for (const auto& t : inputs) {
      sizes.push_back(t.sizes().vec());
      dtypes.push_back(t.scalar_type());
    }
    auto it = std::find_if(entries.begin(), entries.end(), [&](const Cache::Entry& e) {
      return e.sizes == sizes && e.dtypes == dtypes && e.device == device;
    });
    if (it == entries.end()) {
      const auto index = device.index();
      c10::cuda::CUDAGuard device_guard(device);
      const auto current = c10::cuda::getCurrentCUDAStream(index);
      if (static_cast<int>(entries.size()) >= max_graphs_) {
        current.synchronize();
        entries.pop_back();
      }
      Cache::Entry e;
      e.sizes = sizes;
      e.dtypes = dtypes;
      e.device = device;
      for (const auto& t : inputs) e.inputs.push_back(t.clone());  // on the caller's stream, where replays read them
      e.graph = std::make_unique<at::cuda::CUDAGraph>();
      // Captures need a stream other than the legacy default one; the caller's may be either.
      auto capture = c10::cuda::getStreamFromPool(false, index);
      at::cuda::CUDAEvent behind;
      behind.record(current);
      behind.block(capture);
      {
        c10::cuda::CUDAStreamGuard stream_guard(capture);
        for (int i = 0; i < 2; ++i) f_(e.inputs);
        // Thread-local capture: other threads keep launching work on their own devices.
        e.graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
        e.out = f_(e.inputs);
        e.graph->capture_end();
      }
      at::cuda::CUDAEvent captured;
      captured.record(capture);
      captured.block(current);
      entries.push_front(std::move(e));
      it = entries.begin();
    } else if (it != entries.begin()) {
      entries.splice(entries.begin(), entries, it);
      it = entries.begin();
    }
    for (std::size_t i = 0; i < inputs.size(); ++i) it->inputs[i].copy_(inputs[i]);
    it->graph->replay();
    return it->out.clone();
  }
#endif
  return f_(inputs);
}

}  // namespace diffract
