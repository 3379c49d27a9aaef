#pragma once
// Functions of tensors replayed from CUDA graphs, one per set of input shapes and dtypes, as
// UNetGraphRunner does for the whole UNet (unet_graphs.h): the first call for a shape runs it
// eagerly (capture_warmed_up: cuDNN's plans, GEMM tuning, workspaces) and captures it; later
// calls copy into the static inputs and replay.
//  GraphCache: the machinery, for functions of several tensors to several tensors, keyed also
//   by a caller's tag (which function: UNetGraphRunner's stage calls keep one cache for all of
//   their layer ranges and splits).
//  GraphedFunction: one function, one output. SD3's transformer step uses it. (Graphing the
//   TAESD preview decode measured no cheaper than eager, docs/benchmarks.md.)
// Eager on the CPU and when disabled.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/MemoryFormat.h>

namespace at::cuda {
struct CUDAGraph;
}

namespace diffract {

// graph.capture_begin (this thread's work only), f(), graph.capture_end(). Should f throw (out of
// memory mid-capture) or the capture fail to end, the capture is ended and, where LibTorch left
// it so, the allocators told it is over and its pool handed back before the exception goes on:
// otherwise the allocator keeps serving this thread from the graph's pool, frees no cached memory
// again, and every later large job fails. CUDA builds only.
void capture_graph(at::cuda::CUDAGraph& graph, const std::function<void()>& f);

// How many times a function runs eagerly before its capture (DIFFRACT_GRAPH_WARMUPS, read once):
// 1 or 2, or 0 for "auto" (capture_warmed_up's first capture comes without any).
int graph_warmups();

// Work inside a capture that an eager call should have done first calls this: a shape without
// its tuning choice (it took the untimed path), a workspace or fp8 weight made inside the capture.
// capture_warmed_up redoes such a capture after eager calls. Counts per thread (captures are
// thread-local).
void note_unprepared_in_capture();

// What a graph's first call spent before its replay, in host wall time (the GPU may still be
// running the warm-ups when the capture starts).
struct CaptureStats {
  double total_ms = 0;    // the whole first call until the capture is done and the device caught up
  double warm_up_ms = 0;  // the eager calls before the kept capture
  double capture_ms = 0;  // capturing and instantiating it (a discarded capture included)
  int warmups = 0;        // eager calls made
  bool redone = false;    // a capture without warm-ups met unprepared work and was discarded
};

#ifdef DIFFRACT_HAS_CUDA
// `f` (which runs the function and keeps its outputs) captured into a new graph: graph_warmups()
// eager calls of f first; with "auto" none, and where that capture met unprepared work
// (note_unprepared_in_capture) or threw, the graph is discarded and f captured again after two
// eager calls. A size whose tuning choices are all known (the tuning store) is captured with no
// eager call. The calls and the capture run on the device's kept capture stream (captures need a
// stream other than the legacy default one, which the caller's may be), after the work queued on
// the device's current stream; that stream then waits for them, and this returns once the device
// has caught up. Thread-local capture: other threads (ranks) keep launching work on their devices.
std::unique_ptr<at::cuda::CUDAGraph> capture_warmed_up(c10::DeviceIndex device, const std::function<void()>& f,
                                                       CaptureStats& stats);
#endif

class GraphCache {
 public:
  using Function = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
  // Keeps the `max_graphs` most recently used keys (each graph holds its own memory pool).
  explicit GraphCache(int max_graphs = 2);
  ~GraphCache();
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  // True when run() would replay a graph: max_graphs > 0 and the inputs on a CUDA device.
  bool graphable(const std::vector<at::Tensor>& inputs) const;
  // f(inputs), replayed from the graph of the key (tag, every input's sizes and dtype, the
  // device), captured on the key's first call (capture_warmed_up, on the inputs' copies);
  // f(inputs) itself when !graphable(inputs). `f` must be capturable (no host synchronisation,
  // no CPU tensors) and do the same work for a given key. Every input must be a defined tensor on
  // one device. The outputs are tensors of their own (copies of the graph's static outputs, made
  // on the current stream right after the replay: the next replay cannot touch them), except that
  // an output that is one of f's inputs passed through unchanged comes back as the caller's
  // tensor, and outputs that were one tensor inside f share one copy. `layout`: the static 4-D
  // inputs' memory format (the copies convert), else each input's own as on the first call.
  std::vector<at::Tensor> run(const std::vector<std::int64_t>& tag, const std::vector<at::Tensor>& inputs,
                              const Function& f, std::optional<at::MemoryFormat> layout = std::nullopt);
  int graphs() const;
  int max_graphs() const { return max_graphs_; }
  void set_max_graphs(int n);      // drops the least recently used graphs above n
  void clear();                    // drops every graph and its memory

 private:
  struct Cache;
  int max_graphs_;
  std::unique_ptr<Cache> cache_;
};

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
  int graphs() const { return cache_.graphs(); }
  void clear() { cache_.clear(); }  // drops every graph and its memory

 private:
  Function f_;
  bool enabled_ = true;
  GraphCache cache_;
};

}  // namespace diffract
