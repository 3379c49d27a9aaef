#pragma once
// Weights straight from a checkpoint's (memory-mapped) CPU tensors onto a device, in the
// device's dtype: each tensor is cut into chunks that a CPU copy moves into pinned host buffers
// (several threads, where the pages of the mapping are read) while the previous chunk travels
// to the device and is converted there (a copy stream, two buffers in turn). Against binding into
// CPU tensors and moving the module afterwards, no CPU pass converts dtypes and no CPU copy of
// the model is made.
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace diffract::io {

struct UploadStats {
  std::int64_t tensors = 0;
  std::int64_t bytes = 0;  // read from the checkpoint (its dtype)
  double ms = 0;           // until the last byte is on the device
};

class Uploader {
 public:
  // Floating-point tensors become `dtype` on `device`; others keep theirs. `chunk_bytes`: the size
  // of each of the two staging buffers.
  Uploader(c10::Device device, at::ScalarType dtype, std::int64_t chunk_bytes = std::int64_t(64) << 20);
  ~Uploader();
  Uploader(const Uploader&) = delete;
  Uploader& operator=(const Uploader&) = delete;

  // `source` (CPU, any layout) as a new tensor on the device, filled once finish() returns.
  at::Tensor upload(const at::Tensor& source);
  // Waits for every upload; adds them to stats().
  void finish();
  const UploadStats& stats() const { return stats_; }
  c10::Device device() const { return device_; }
  at::ScalarType dtype() const { return dtype_; }

 private:
  struct Staging;
  c10::Device device_;
  at::ScalarType dtype_;
  std::int64_t chunk_bytes_;
  std::unique_ptr<Staging> staging_;
  UploadStats stats_;
  double started_ms_ = -1;
};

// While one is alive on a thread, bind() on that thread puts the bound weights on its device
// through an Uploader (replacing the module's CPU tensors) instead of copying into them. The
// pipelines hold one while they load a model for a GPU.
class ScopedPlacement {
 public:
  ScopedPlacement(c10::Device device, at::ScalarType dtype, std::int64_t chunk_bytes = std::int64_t(64) << 20);
  ~ScopedPlacement();
  ScopedPlacement(const ScopedPlacement&) = delete;
  ScopedPlacement& operator=(const ScopedPlacement&) = delete;
  // Every bind() so far under this placement.
  const UploadStats& stats() const;

  static Uploader* current();  // this thread's, or null

 private:
  std::unique_ptr<Uploader> uploader_;
  Uploader* previous_;
};

// While one is alive on a thread, bind() there copies into the module's own tensors again, whatever
// placement is active (a model part that lives elsewhere: Flux's T5 on the CPU).
class SuspendedPlacement {
 public:
  SuspendedPlacement();
  ~SuspendedPlacement();
  SuspendedPlacement(const SuspendedPlacement&) = delete;
  SuspendedPlacement& operator=(const SuspendedPlacement&) = delete;

 private:
  Uploader* previous_;
};

}  // namespace diffract::io
