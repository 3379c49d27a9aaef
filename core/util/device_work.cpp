#include "core/util/device_work.h"

#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <utility>

#include <ATen/ATen.h>

#ifdef DIFFRACT_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDACachingAllocator.h>
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
#ifdef DIFFRACT_HAS_CUDA
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> marks;  // [0] is start()
  std::size_t reported = 0;                                  // marks[1..reported] reported
#endif
  explicit Impl(const c10::Device& d) : device(d) {}
};

StepClock::StepClock(const c10::Device& device) : impl_(std::make_unique<Impl>(device)) {}
StepClock::~StepClock() = default;

void StepClock::start() {
  auto& p = *impl_;
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
  int capacity;
  struct Job {
    int tag = 0;
#ifdef DIFFRACT_HAS_CUDA
    std::unique_ptr<at::cuda::CUDAEvent> begin, end;
    at::Tensor result;
#endif
    at::Tensor host;
    double cpu_ms = 0;
  };
  std::deque<Job> jobs;  // oldest first
#ifdef DIFFRACT_HAS_CUDA
  std::optional<c10::cuda::CUDAStream> side;
#endif
  Impl(const c10::Device& d, int c) : device(d), capacity(std::max(c, 1)) {}

  Done done(Job& j) {
    Done d;
    d.tag = j.tag;
    d.host = std::move(j.host);
    d.device_ms = j.cpu_ms;
#ifdef DIFFRACT_HAS_CUDA
    if (j.end) d.device_ms = j.begin->elapsed_time(*j.end);
#endif
    return d;
  }
};

#ifdef DIFFRACT_HAS_CUDA
c10::cuda::CUDAStream kept_stream(c10::DeviceIndex device, KeptStream use) {
  static std::mutex mutex;
  static std::map<std::pair<c10::DeviceIndex, KeptStream>, c10::cuda::CUDAStream> streams;
  std::lock_guard lock(mutex);
  auto it = streams.find({device, use});
  if (it == streams.end()) it = streams.emplace(std::pair{device, use}, c10::cuda::getStreamFromPool(false, device)).first;
  return it->second;
}
#endif

SideStreamTask::SideStreamTask(const c10::Device& device, int capacity)
    : impl_(std::make_unique<Impl>(device, capacity)) {
#ifdef DIFFRACT_HAS_CUDA
  if (device.is_cuda()) impl_->side = kept_stream(device.index(), KeptStream::Side);
#endif
}

SideStreamTask::~SideStreamTask() {
  try {
    while (wait()) {
    }
  } catch (...) {
  }
}

bool SideStreamTask::busy() const { return static_cast<int>(impl_->jobs.size()) >= impl_->capacity; }

bool SideStreamTask::try_start(int tag, const std::vector<at::Tensor>& inputs, const std::function<at::Tensor()>& work) {
  auto& p = *impl_;
  if (busy()) return false;
  Impl::Job j;
  j.tag = tag;
#ifdef DIFFRACT_HAS_CUDA
  if (p.device.is_cuda()) {
    const auto main = c10::cuda::getCurrentCUDAStream(p.device.index());
    at::cuda::CUDAEvent behind;
    behind.record(main);
    behind.block(*p.side);
    c10::cuda::CUDAStreamGuard guard(*p.side);
    for (const auto& t : inputs)
      if (t.defined() && t.is_cuda()) t.record_stream(*p.side);
    j.begin = std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault);
    j.end = std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault);
    j.begin->record(*p.side);
    j.result = work();
    j.host = at::empty(j.result.sizes(), j.result.options().device(at::kCPU).pinned_memory(true));
    j.host.copy_(j.result, /*non_blocking=*/true);
    j.end->record(*p.side);
    p.jobs.push_back(std::move(j));
    return true;
  }
#endif
  (void)inputs;
  const auto t0 = Clock::now();
  j.host = work().to(at::kCPU);
  j.cpu_ms = ms_between(t0, Clock::now());
  p.jobs.push_back(std::move(j));
  return true;
}

std::optional<SideStreamTask::Done> SideStreamTask::poll() {
  auto& p = *impl_;
  if (p.jobs.empty()) return std::nullopt;
  auto& j = p.jobs.front();
#ifdef DIFFRACT_HAS_CUDA
  if (j.end && !j.end->query()) return std::nullopt;
#endif
  auto d = p.done(j);
  p.jobs.pop_front();
  return d;
}

std::optional<SideStreamTask::Done> SideStreamTask::wait() {
  auto& p = *impl_;
  if (p.jobs.empty()) return std::nullopt;
#ifdef DIFFRACT_HAS_CUDA
  if (p.jobs.front().end) p.jobs.front().end->synchronize();
#endif
  return poll();
}

void reset_peak_memory(const c10::Device& device) {
#ifdef DIFFRACT_HAS_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
}

void release_cached_memory() {
#ifdef DIFFRACT_HAS_CUDA
  if (c10::cuda::device_count() > 0) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

std::int64_t peak_memory(const c10::Device& device) {
#ifdef DIFFRACT_HAS_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  return 0;
}

}  // namespace diffract
