#include "core/models/unets/unet_graphs.h"

#include <chrono>
#include <list>
#include <tuple>

#include <ATen/ATen.h>

#ifdef DIFFRACT_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace diffract::models {

namespace {
using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, int, bool>;

Key key_of(const at::Tensor& x, const UNetConditioning& c) {
  return {x.size(0), x.size(1), x.size(2), x.size(3), c.encoder_hidden_states.size(1),
          static_cast<int>(x.scalar_type()), c.text_embeds.defined()};
}
}  // namespace

struct UNetGraphRunner::Cache {
  double last_capture_ms = 0;
#ifdef DIFFRACT_HAS_CUDA
  struct Entry {
    Key key;
    at::Tensor x, t, out;
    UNetConditioning cond;
    std::unique_ptr<at::cuda::CUDAGraph> graph;
  };
  std::list<Entry> entries;  // most recently used first
#endif
};

UNetGraphRunner::UNetGraphRunner(UNet2DConditionModel unet, UNetGraphOptions options)
    : unet_(std::move(unet)), options_(options), cache_(std::make_unique<Cache>()) {
  if (options_.channels_last) {
    options_.channels_last = false;
    set_channels_last(true);
  }
}

void UNetGraphRunner::set_channels_last(bool on) {
  if (on == options_.channels_last) return;
  clear();
  set_memory_format(*unet_, on ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
  options_.channels_last = on;
}

UNetGraphRunner::~UNetGraphRunner() { clear(); }

int UNetGraphRunner::graphs() const {
#ifdef DIFFRACT_HAS_CUDA
  return static_cast<int>(cache_->entries.size());
#else
  return 0;
#endif
}

double UNetGraphRunner::last_capture_ms() const { return cache_->last_capture_ms; }

void UNetGraphRunner::clear() {
#ifdef DIFFRACT_HAS_CUDA
  if (cache_->entries.empty()) return;
  // A replay may still be running on the device when its pool is handed back.
  const auto device = cache_->entries.front().x.device();
  c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
  cache_->entries.clear();
#endif
}

at::Tensor UNetGraphRunner::forward(const at::Tensor& sample, const at::Tensor& timesteps, const UNetConditioning& cond) {
#ifdef DIFFRACT_HAS_CUDA
  if (options_.enabled && options_.max_graphs > 0 && sample.is_cuda()) {
    auto& entries = cache_->entries;
    const Key key = key_of(sample, cond);
    auto it = std::find_if(entries.begin(), entries.end(), [&](const Cache::Entry& e) { return e.key == key; });
    if (it == entries.end()) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto index = sample.device().index();
      c10::cuda::CUDAGuard device_guard(sample.device());
      if (static_cast<int>(entries.size()) >= options_.max_graphs) {
        c10::cuda::getCurrentCUDAStream(index).synchronize();
        entries.pop_back();
      }
      // Static buffers are made on the caller's stream, where the replays will read them.
      Cache::Entry e;
      e.key = key;
      e.x = sample.clone(options_.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
      e.t = timesteps.to(at::kFloat).clone();
      e.cond.encoder_hidden_states = cond.encoder_hidden_states.clone();
      if (cond.text_embeds.defined()) e.cond.text_embeds = cond.text_embeds.clone();
      if (cond.time_ids.defined()) e.cond.time_ids = cond.time_ids.clone();
      e.graph = std::make_unique<at::cuda::CUDAGraph>();
      const auto main = c10::cuda::getCurrentCUDAStream(index);
      auto side = c10::cuda::getStreamFromPool(false, index);
      at::cuda::CUDAEvent behind;
      behind.record(main);
      behind.block(side);
      {
        c10::cuda::CUDAStreamGuard stream_guard(side);
        for (int i = 0; i < 2; ++i) unet_->forward(e.x, e.t, e.cond);  // cuDNN / cuBLAS plans and workspaces
        // Thread-local capture: other ranks' threads keep launching work on their own devices.
        e.graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
        e.out = unet_->forward(e.x, e.t, e.cond);
        e.graph->capture_end();
      }
      at::cuda::CUDAEvent captured;
      captured.record(side);
      captured.block(main);
      entries.push_front(std::move(e));
      it = entries.begin();
      main.synchronize();
      cache_->last_capture_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    } else if (it != entries.begin()) {
      entries.splice(entries.begin(), entries, it);
      it = entries.begin();
    }
    it->x.copy_(sample);
    it->t.copy_(timesteps);
    it->cond.encoder_hidden_states.copy_(cond.encoder_hidden_states);
    if (cond.text_embeds.defined()) it->cond.text_embeds.copy_(cond.text_embeds);
    if (cond.time_ids.defined()) it->cond.time_ids.copy_(cond.time_ids);
    it->graph->replay();
    return it->out.clone(at::MemoryFormat::Contiguous);
  }
#endif
  if (options_.channels_last)
    return unet_->forward(sample.contiguous(at::MemoryFormat::ChannelsLast), timesteps, cond).contiguous();
  return unet_->forward(sample, timesteps, cond);
}

}  // namespace diffract::models
