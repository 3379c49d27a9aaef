#include "core/io/upload.h"

#include <chrono>
#include <cstring>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#ifdef DIFFRACT_HAS_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "core/util/error.h"

namespace diffract::io {

namespace {
double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
thread_local Uploader* t_current = nullptr;

// Many page faults of a mapped file are served faster by several threads than by one.
void parallel_memcpy(std::byte* dst, const std::byte* src, std::int64_t n) {
  constexpr std::int64_t grain = std::int64_t(4) << 20;
  at::parallel_for(0, n, grain, [&](std::int64_t a, std::int64_t b) {
    std::memcpy(dst + a, src + a, static_cast<std::size_t>(b - a));
  });
}
}  // namespace

struct Uploader::Staging {
  at::Tensor host[2];  // pinned on CUDA
  int next = 0;
#ifdef DIFFRACT_HAS_CUDA
  std::optional<c10::cuda::CUDAStream> stream;
  at::cuda::CUDAEvent freed[2];  // the buffer's last transfer has left it
  bool used[2] = {false, false};
#endif
};

Uploader::Uploader(c10::Device device, at::ScalarType dtype, std::int64_t chunk_bytes)
    : device_(device), dtype_(dtype), chunk_bytes_(chunk_bytes), staging_(std::make_unique<Staging>()) {
  if (chunk_bytes_ < 64) throw Error("weight upload: chunks of " + std::to_string(chunk_bytes_) + " bytes");
  chunk_bytes_ -= chunk_bytes_ % 16;  // whole elements of every dtype
  const bool cuda = device_.is_cuda();
#ifndef DIFFRACT_HAS_CUDA
  if (cuda) throw Error("weight upload to " + device_.str() + ": this build has no CUDA");
#else
  if (cuda) staging_->stream = c10::cuda::getStreamFromPool(false, device_.index());
#endif
  for (auto& h : staging_->host)
    h = at::empty({chunk_bytes_}, at::TensorOptions().dtype(at::kByte).pinned_memory(cuda));
}

Uploader::~Uploader() {
  try {
    finish();
  } catch (...) {
  }
}

at::Tensor Uploader::upload(const at::Tensor& source) {
  if (!source.device().is_cpu()) throw Error("weight upload: the source is on " + source.device().str());
  if (started_ms_ < 0) started_ms_ = now_ms();
  const auto src = source.contiguous();
  const auto target_dtype = at::isFloatingType(src.scalar_type()) ? dtype_ : src.scalar_type();
  auto out = at::empty(src.sizes(), at::TensorOptions().device(device_).dtype(target_dtype));
  const std::int64_t elem = static_cast<std::int64_t>(src.element_size());
  const std::int64_t per_chunk = chunk_bytes_ / elem;
  const auto* bytes = static_cast<const std::byte*>(src.const_data_ptr());
  auto flat = out.view(-1);
#ifdef DIFFRACT_HAS_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> on_stream;
  if (staging_->stream) {
    // `out` was allocated on the caller's stream: the copy stream must not write it earlier.
    at::cuda::CUDAEvent made;
    made.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    made.block(*staging_->stream);
    on_stream.emplace(*staging_->stream);
  }
#endif
  for (std::int64_t first = 0; first < src.numel(); first += per_chunk) {
    const std::int64_t n = std::min(per_chunk, src.numel() - first);
    const int slot = staging_->next;
    staging_->next ^= 1;
    auto& host = staging_->host[slot];
#ifdef DIFFRACT_HAS_CUDA
    if (staging_->stream && staging_->used[slot]) staging_->freed[slot].synchronize();
#endif
    parallel_memcpy(static_cast<std::byte*>(host.data_ptr()), bytes + first * elem, n * elem);
    const auto chunk = host.narrow(0, 0, n * elem).view(src.scalar_type());
    // Non-blocking: the transfer leaves pinned memory and any dtype conversion runs on the device.
    flat.narrow(0, first, n).copy_(chunk, /*non_blocking=*/device_.is_cuda());
#ifdef DIFFRACT_HAS_CUDA
    if (staging_->stream) {
      staging_->freed[slot].record(*staging_->stream);
      staging_->used[slot] = true;
    }
#endif
  }
#ifdef DIFFRACT_HAS_CUDA
  // The caller's stream uses `out` only after the copies (and the allocator knows it).
  if (staging_->stream) out.record_stream(*staging_->stream);
#endif
  stats_.tensors += 1;
  stats_.bytes += src.numel() * elem;
  return out;
}

void Uploader::finish() {
#ifdef DIFFRACT_HAS_CUDA
  if (staging_->stream) {
    at::cuda::CUDAEvent done;
    done.record(*staging_->stream);
    done.block(c10::cuda::getCurrentCUDAStream(device_.index()));
    staging_->stream->synchronize();
  }
#endif
  if (started_ms_ >= 0) {
    stats_.ms += now_ms() - started_ms_;
    started_ms_ = -1;
  }
}

ScopedPlacement::ScopedPlacement(c10::Device device, at::ScalarType dtype, std::int64_t chunk_bytes)
    : uploader_(std::make_unique<Uploader>(device, dtype, chunk_bytes)), previous_(t_current) {
  t_current = uploader_.get();
}

ScopedPlacement::~ScopedPlacement() { t_current = previous_; }

const UploadStats& ScopedPlacement::stats() const { return uploader_->stats(); }

Uploader* ScopedPlacement::current() { return t_current; }

SuspendedPlacement::SuspendedPlacement() : previous_(t_current) { t_current = nullptr; }
SuspendedPlacement::~SuspendedPlacement() { t_current = previous_; }

}  // namespace diffract::io
