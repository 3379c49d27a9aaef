#include "core/util/graphed_function.h"

#include "core/util/device_work.h"
#include "core/util/options.h"

#include <algorithm>
#include <chrono>
#include <list>
#include <map>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/ScopeExit.h>

#ifdef DIFFRACT_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace diffract {

struct GraphCache::Cache {
#ifdef DIFFRACT_HAS_CUDA
  struct Entry {
    std::vector<std::int64_t> tag;
    std::vector<std::vector<std::int64_t>> sizes;
    std::vector<at::ScalarType> dtypes;
    at::Device device{at::kCPU};
    std::vector<at::Tensor> inputs, outputs;
    // Per output: the input it is (passed through, >= 0), or an earlier output it is (-2 - j).
    std::vector<int> same;
    std::unique_ptr<at::cuda::CUDAGraph> graph;
  };
  std::list<Entry> entries;  // most recently used first

  // A replay may still be running on the device when its pool is handed back.
  void drop_last() {
    c10::cuda::getCurrentCUDAStream(entries.back().device.index()).synchronize();
    entries.pop_back();
  }
#endif
};

GraphCache::GraphCache(int max_graphs) : max_graphs_(max_graphs), cache_(std::make_unique<Cache>()) {}

GraphCache::~GraphCache() { clear(); }

bool GraphCache::graphable(const std::vector<at::Tensor>& inputs) const {
#ifdef DIFFRACT_HAS_CUDA
  return max_graphs_ > 0 && !inputs.empty() && inputs.front().is_cuda();
#else
  (void)inputs;
  return false;
#endif
}

int GraphCache::graphs() const {
#ifdef DIFFRACT_HAS_CUDA
  return static_cast<int>(cache_->entries.size());
#else
  return 0;
#endif
}


void GraphCache::set_max_graphs(int n) {
  max_graphs_ = n;
#ifdef DIFFRACT_HAS_CUDA
  while (static_cast<int>(cache_->entries.size()) > std::max(n, 0)) cache_->drop_last();
#endif
}

#ifdef DIFFRACT_HAS_CUDA
namespace {
// When cudaStreamEndCapture fails (a capture invalidated, e.g. by the allocator's own
// out-of-memory path inside it), LibTorch's CUDAGraph::capture_end throws before it tells the
// allocators the capture is over, and its reset() hands back only the pool of a capture that
// ended. Left so, the device allocator keeps a capture underway for good: emptyCache then frees
// none of the ordinary pools, and every later large job on that device runs out of memory (an
// H100 with the captures made without eager calls first). A capture that did not end is ended
// with the allocators here, and its pool handed back.
void abandon_capture(at::cuda::CUDAGraph& graph, c10::MempoolId_t pool) {
  try {
    (void)graph.pool();
    return;  // it ended: the graph's reset() hands its pool back
  } catch (const c10::Error&) {
  }
  const auto device = c10::cuda::current_device();
  try {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
  } catch (const c10::Error&) {  // capture_end got as far as this
  }
  try {
    at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool);
  } catch (const c10::Error&) {
  }
  c10::cuda::CUDACachingAllocator::releasePool(device, pool);
  at::getHostAllocator(at::kCUDA)->release_pool(pool);
}
}  // namespace
#endif

void capture_graph(at::cuda::CUDAGraph& graph, const std::function<void()>& f) {
#ifdef DIFFRACT_HAS_CUDA
  const auto pool = at::cuda::graph_pool_handle();  // known here, for abandon_capture
  graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
  try {
    f();
  } catch (...) {
    try {
      graph.capture_end();
    } catch (...) {  // an invalidated capture: ending it is all that matters
    }
    abandon_capture(graph, pool);
    throw;
  }
  try {
    graph.capture_end();
  } catch (...) {
    abandon_capture(graph, pool);
    throw;
  }
#else
  (void)graph;
  f();
#endif
}

int graph_warmups() {
  static const int n = [] {
    const auto v = options::value(options::Id::GraphWarmups);
    return v == "auto" ? 0 : std::stoi(v);
  }();
  return n;
}

namespace {
thread_local std::int64_t t_unprepared = 0;
}

void note_unprepared_in_capture() { ++t_unprepared; }

#ifdef DIFFRACT_HAS_CUDA
namespace {

std::unique_ptr<at::cuda::CUDAGraph> capture_on_current_stream(const std::function<void()>& f, CaptureStats& stats) {
  using clock = std::chrono::steady_clock;
  const auto ms_since = [](clock::time_point t) {
    return std::chrono::duration<double, std::milli>(clock::now() - t).count();
  };
  const auto warm_up = [&](int n) {
    const auto t = clock::now();
    for (int i = 0; i < n; ++i) f();  // tuning, plans and workspaces
    stats.warm_up_ms += ms_since(t);
    stats.warmups += n;
  };
  const auto capture = [&] {
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    const auto t = clock::now();
    const auto timed = c10::make_scope_exit([&] { stats.capture_ms += ms_since(t); });  // a failed capture too
    capture_graph(*graph, f);
    return graph;
  };
  stats = {};
  if (graph_warmups() > 0) {
    warm_up(graph_warmups());
    return capture();
  }
  const auto before = t_unprepared;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  try {
    graph = capture();
  } catch (const c10::OutOfMemoryError&) {
    throw;  // eager calls would not fit either
  } catch (const std::exception&) {
    graph.reset();  // tried again below, after the eager calls
  }
  if (graph && t_unprepared == before) return graph;
  graph.reset();
  stats.redone = true;
  warm_up(2);
  return capture();
}

}  // namespace

std::unique_ptr<at::cuda::CUDAGraph> capture_warmed_up(c10::DeviceIndex device, const std::function<void()>& f,
                                                       CaptureStats& stats) {
  const auto t0 = std::chrono::steady_clock::now();
  c10::cuda::CUDAGuard device_guard(device);
  const auto current = c10::cuda::getCurrentCUDAStream(device);
  const auto capture = kept_stream(device, KeptStream::Capture);
  at::cuda::CUDAEvent behind;
  behind.record(current);
  behind.block(capture);
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  {
    c10::cuda::CUDAStreamGuard stream_guard(capture);
    graph = capture_on_current_stream(f, stats);
  }
  at::cuda::CUDAEvent captured;
  captured.record(capture);
  captured.block(current);
  current.synchronize();
  stats.total_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return graph;
}
#endif

void GraphCache::clear() {
#ifdef DIFFRACT_HAS_CUDA
  while (!cache_->entries.empty()) cache_->drop_last();
#endif
}

std::vector<at::Tensor> GraphCache::run(const std::vector<std::int64_t>& tag, const std::vector<at::Tensor>& inputs,
                                        const Function& f, std::optional<at::MemoryFormat> layout) {
#ifdef DIFFRACT_HAS_CUDA
  if (graphable(inputs)) {
    auto& entries = cache_->entries;
    const auto device = inputs.front().device();
    std::vector<std::vector<std::int64_t>> sizes;
    std::vector<at::ScalarType> dtypes;
    for (const auto& t : inputs) {
      TORCH_CHECK(t.defined() && t.device() == device, "GraphCache: every input must be defined and on ", device);
      sizes.push_back(t.sizes().vec());
      dtypes.push_back(t.scalar_type());
    }
    // The job's precision picks the layers' GEMMs (fp8 or not) when a graph is captured.
    auto key_tag = tag;
    key_tag.push_back(options::value(options::Id::Precision) == "fp8");
    auto it = std::find_if(entries.begin(), entries.end(), [&](const Cache::Entry& e) {
      return e.tag == key_tag && e.sizes == sizes && e.dtypes == dtypes && e.device == device;
    });
    if (it == entries.end()) {
      c10::cuda::CUDAGuard device_guard(device);
      while (!entries.empty() && static_cast<int>(entries.size()) >= max_graphs_) cache_->drop_last();
      Cache::Entry e;
      e.tag = key_tag;
      e.sizes = sizes;
      e.dtypes = dtypes;
      e.device = device;
      // On the caller's stream, where the replays read them.
      for (const auto& t : inputs)
        e.inputs.push_back(layout && t.dim() == 4 ? t.clone(*layout) : t.clone());
      CaptureStats stats;
      e.graph = capture_warmed_up(device.index(), [&] { e.outputs = f(e.inputs); }, stats);
      for (std::size_t o = 0; o < e.outputs.size(); ++o) {
        int same = -1;
        for (std::size_t i = 0; i < e.inputs.size() && same == -1; ++i)
          if (e.outputs[o].is_same(e.inputs[i])) same = static_cast<int>(i);
        for (std::size_t j = 0; j < o && same == -1; ++j)
          if (e.outputs[o].is_same(e.outputs[j])) same = -2 - static_cast<int>(j);
        e.same.push_back(same);
      }
      entries.push_front(std::move(e));
      it = entries.begin();
    } else if (it != entries.begin()) {
      entries.splice(entries.begin(), entries, it);
      it = entries.begin();
    }
    for (std::size_t i = 0; i < inputs.size(); ++i) it->inputs[i].copy_(inputs[i]);
    it->graph->replay();
    std::vector<at::Tensor> out;
    out.reserve(it->outputs.size());
    for (std::size_t o = 0; o < it->outputs.size(); ++o) {
      const int same = it->same[o];
      if (same >= 0) out.push_back(inputs[static_cast<std::size_t>(same)]);
      else if (same <= -2) out.push_back(out[static_cast<std::size_t>(-2 - same)]);
      else out.push_back(it->outputs[o].clone());
    }
    return out;
  }
#endif
  (void)tag;
  (void)layout;
  return f(inputs);
}

GraphedFunction::GraphedFunction(Function f, int max_graphs) : f_(std::move(f)), cache_(max_graphs) {}

GraphedFunction::GraphedFunction(std::function<at::Tensor(const at::Tensor&)> f, int max_graphs)
    : GraphedFunction([f = std::move(f)](const std::vector<at::Tensor>& in) { return f(in.at(0)); }, max_graphs) {}

GraphedFunction::~GraphedFunction() = default;

void GraphedFunction::set_enabled(bool on) {
  if (!on) clear();
  enabled_ = on;
}

at::Tensor GraphedFunction::operator()(const std::vector<at::Tensor>& inputs) {
  if (!enabled_ || !cache_.graphable(inputs)) return f_(inputs);
  const auto& f = f_;
  return cache_.run({}, inputs, [&f](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{f(in)}; })
      .front();
}

}  // namespace diffract
