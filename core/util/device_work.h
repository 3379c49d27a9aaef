#pragma once
// Keeping a device busy while the host follows along: step timing from marks in the device's
// stream (no host synchronisation per step), and work on a side stream whose results the host
// picks up when they are ready. On the CPU both degrade to plain synchronous timing.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#ifdef DIFFRACT_HAS_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace diffract {

#ifdef DIFFRACT_HAS_CUDA
// A pool stream of `device` kept for one use for the process's life, instead of the next pool
// stream each time: cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it has run on,
// for good, so a new pool stream for every job (its previews, or its graph captures) could hold
// up to 32 of them (on an H100, 256 MiB more after 200 cancelled jobs with previews on new
// streams: `diffract-gpu-checks cancel_any`).
enum class KeptStream { Capture, Side };
c10::cuda::CUDAStream kept_stream(c10::DeviceIndex device, KeptStream use);
#endif

// Step i's duration is the device time between the end of step i-1 (or start()) and the end of
// step i, so gaps where the device waited on the host count too: the figures add up to the loop.
class StepClock {
 public:
  explicit StepClock(const c10::Device& device);
  ~StepClock();
  StepClock(const StepClock&) = delete;
  StepClock& operator=(const StepClock&) = delete;

  void start();      // before the first step is enqueued
  void mark_step();  // after a step's work is enqueued
  // Durations (ms) of the steps the device has finished since the last call, in order; never blocks.
  std::vector<double> finished();
  // Blocks until no more than `ahead` marked steps are unfinished; then finished() has the rest.
  void wait_until_ahead(int ahead);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Jobs on a side stream: try_start() enqueues `work` behind everything already on the device's
// current stream and copies its result to pinned host memory. Up to `capacity` jobs may be in
// flight (the host runs a few steps ahead of the device, so a preview waits that long before it
// can start); beyond that try_start() refuses and the caller drops the job rather than stall.
// On the CPU work runs at once.
class SideStreamTask {
 public:
  explicit SideStreamTask(const c10::Device& device, int capacity = 4);
  ~SideStreamTask();
  SideStreamTask(const SideStreamTask&) = delete;
  SideStreamTask& operator=(const SideStreamTask&) = delete;

  struct Done {
    int tag = 0;
    at::Tensor host;    // the result on the CPU
    double device_ms = 0;  // the work's time on the side stream
  };
  // `inputs`: the tensors `work` reads that were made on the main stream; they stay reserved for
  // the side stream until it has used them, even if the caller drops them at once.
  bool try_start(int tag, const std::vector<at::Tensor>& inputs, const std::function<at::Tensor()>& work);
  bool busy() const;           // `capacity` jobs in flight
  std::optional<Done> poll();  // the oldest job, once it is finished
  std::optional<Done> wait();  // blocks for the oldest job in flight, if any

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The caching allocator's peak of memory allocated on a CUDA device since the last reset (0 on
// the CPU): what a job's ranks report as their memory per GPU.
void reset_peak_memory(const c10::Device& device);
// Hands the blocks the caching allocator keeps back to every CUDA device (after a job ran out of
// memory, so the next one starts from what the models hold). Nothing without CUDA.
void release_cached_memory();
std::int64_t peak_memory(const c10::Device& device);

}  // namespace diffract
