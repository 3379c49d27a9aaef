#include "core/util/device_work.h"

#include <chrono>

#include <ATen/ATen.h>

#ifdef DIFFRACT_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace diffract {

namespace {
using Clock = std::chrono::steady_clock;
double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
}  // namespace

struct StepClock::Impl {
  c10::Device device;
  // CPU: the host clock, each step measured as it is marked.
  Clock::time_point last;
  std::vector<double> pending;
  int marked = 0;
#ifdef DIFFRACT_HAS_CUDA
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> marks;  // [0] is start()
  std::size_t reported = 0;                                  // marks[1..reported] reported
#endif
  explicit Impl(const c10::Device& d) : device(d) {}
};

StepClock::StepClock(const c10::Device& device) : impl_(std::make_unique<Impl>(device)) {}
StepClock::~StepClock() = default;
int StepClock::marked() const { return impl_->marked; }

void StepClock::start() {
  auto& p = *impl_;
  p.marked = 0;
  p.pending.clear();
  p.last = Clock::now();
#ifdef DIFFRACT_HAS_CUDA
  if (p.device.is_cuda()) {
    p.marks.clear();
    p.reported = 0;
    p.marks.push_back(std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault));
    p.marks.back()->record(c10::cuda::getCurrentCUDAStream(p.device.index()));
  }
#endif
}

void StepClock::mark_step() {
  auto& p = *impl_;
  ++p.marked;
#ifdef DIFFRACT_HAS_CUDA
  if (p.device.is_cuda()) {
    p.marks.push_back(std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault));
    p.marks.back()->record(c10::cuda::getCurrentCUDAStream(p.device.index()));
    return;
  }
#endif
  const auto now = Clock::now();
  p.pending.push_back(ms_between(p.last, now));
  p.last = now;
}

std::vector<double> StepClock::finished() {
  auto& p = *impl_;
#ifdef DIFFRACT_HAS_CUDA
  if (p.device.is_cuda()) {
    std::vector<double> out;
    while (p.reported + 1 < p.marks.size() && p.marks[p.reported + 1]->query()) {
      out.push_back(p.marks[p.reported]->elapsed_time(*p.marks[p.reported + 1]));
      ++p.reported;
    }
    return out;
  }
#endif
  return std::exchange(p.pending, {});
}

void StepClock::wait_until_ahead(int ahead) {
#ifdef DIFFRACT_HAS_CUDA
  auto& p = *impl_;
  if (p.device.is_cuda()) {
    const auto n = static_cast<std::ptrdiff_t>(p.marks.size()) - 1 - std::max(ahead, 0);
    if (n >= 1) p.marks[static_cast<std::size_t>(n)]->synchronize();
  }
#else
  (void)ahead;
#endif
}

struct SideStreamTask::Impl {
  c10::Device device;
  bool busy = false;
  std::optional<Done> ready;  // CPU: finished at once
#ifdef DIFFRACT_HAS_CUDA
  std::optional<c10::cuda::CUDAStream> side;
  at::cuda::CUDAEvent begin{cudaEventDefault}, end{cudaEventDefault};
  at::Tensor result, host;
  int tag = 0;
#endif
  explicit Impl(const c10::Device& d) : device(d) {}
};

SideStreamTask::SideStreamTask(const c10::Device& device) : impl_(std::make_unique<Impl>(device)) {
#ifdef DIFFRACT_HAS_CUDA
  if (device.is_cuda()) impl_->side = c10::cuda::getStreamFromPool(false, device.index());
#endif
}

SideStreamTask::~SideStreamTask() {
  try {
    wait();
  } catch (...) {
  }
}

bool SideStreamTask::busy() const { return impl_->busy; }

bool SideStreamTask::try_start(int tag, const std::vector<at::Tensor>& inputs, const std::function<at::Tensor()>& work) {
  auto& p = *impl_;
  if (p.busy) return false;
#ifdef DIFFRACT_HAS_CUDA
  if (p.device.is_cuda()) {
    const auto main = c10::cuda::getCurrentCUDAStream(p.device.index());
    at::cuda::CUDAEvent behind;
    behind.record(main);
    behind.block(*p.side);
    c10::cuda::CUDAStreamGuard guard(*p.side);
    p.begin.record(*p.side);
    for (const auto& t : inputs)
      if (t.defined() && t.is_cuda()) t.record_stream(*p.side);
    p.result = work();
    p.host = at::empty(p.result.sizes(), p.result.options().device(at::kCPU).pinned_memory(true));
    p.host.copy_(p.result, /*non_blocking=*/true);
    p.end.record(*p.side);
    p.tag = tag;
    p.busy = true;
    return true;
  }
#endif
  (void)inputs;
  const auto t0 = Clock::now();
  Done d;
  d.tag = tag;
  d.host = work().to(at::kCPU);
  d.device_ms = ms_between(t0, Clock::now());
  p.ready = std::move(d);
  p.busy = true;
  return true;
}

std::optional<SideStreamTask::Done> SideStreamTask::poll() {
  auto& p = *impl_;
  if (!p.busy) return std::nullopt;
#ifdef DIFFRACT_HAS_CUDA
  if (p.device.is_cuda()) {
    if (!p.end.query()) return std::nullopt;
    Done d;
    d.tag = p.tag;
    d.host = std::exchange(p.host, at::Tensor());
    d.device_ms = p.begin.elapsed_time(p.end);
    p.result = at::Tensor();
    p.busy = false;
    return d;
  }
#endif
  p.busy = false;
  return std::exchange(p.ready, std::nullopt);
}

std::optional<SideStreamTask::Done> SideStreamTask::wait() {
  auto& p = *impl_;
  if (!p.busy) return std::nullopt;
#ifdef DIFFRACT_HAS_CUDA
  if (p.device.is_cuda()) p.end.synchronize();
#endif
  return poll();
}

}  // namespace diffract
