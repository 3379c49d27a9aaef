#pragma once
// What the strategies' loops share (strategy.cpp and each strategy's file): per-rank replicas of the
// sampler, generator and denoiser, the cancel gate, the refine step and the stats.
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "core/parallel/strategy.h"

namespace diffract::parallel::detail {

struct Rank {
  std::unique_ptr<schedulers::Sampler> sampler;
  at::Generator gen;
  std::unique_ptr<Denoiser> den;
  at::Tensor x;
  at::Tensor mask, image_latents, noise;  // LoopInputs' blend tensors on this rank's device
};

// Throws unless the group has the strategy's device count.
void check_group(const Strategy& s, const DeviceGroup& g);
// Per-rank replicas, made on the calling thread before the workers start; validates the job.
std::vector<Rank> prepare(const Strategy& s, DeviceGroup& g, const LoopInputs& in);

// Whether to stop before round r, decided once by the first rank to get there, so every rank
// stops at the same round and none is left waiting in a collective for a peer that quit.
class CancelGate {
 public:
  explicit CancelGate(const job::CancelToken* token) : token_(token) {}
  void check(int round);

 private:
  const job::CancelToken* token_;
  std::mutex mutex_;
  std::map<int, bool> decided_;
};

// Point-to-point messages and their bytes per step, counted from every rank's thread
// (PipeFusion, AsyncDiff: LoopStats::messages_per_step / bytes_per_step).
class StepTraffic {
 public:
  explicit StepTraffic(int steps) : messages_(static_cast<std::size_t>(steps), 0), bytes_(messages_) {}
  void sent(int step, const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++messages_[static_cast<std::size_t>(step)];
    bytes_[static_cast<std::size_t>(step)] += static_cast<std::int64_t>(t.nbytes());
  }
  const std::vector<std::int64_t>& messages() const { return messages_; }
  const std::vector<std::int64_t>& bytes() const { return bytes_; }

 private:
  std::mutex mutex_;
  std::vector<std::int64_t> messages_, bytes_;
};

// A rank's share of a batch split over n devices (data-parallel, dp- caches): contiguous rows,
// batch / n each and one more on the first batch % n ranks.
struct BatchSlice {
  std::int64_t begin = 0, count = 0;
  std::int64_t widest = 0;  // the largest share's rows
};
BatchSlice batch_slice(std::int64_t batch, int n, int rank);
// The shares' row counts, each once (one, or two when n does not divide the batch): what a
// warm-up prepares.
std::vector<std::int64_t> share_sizes(std::int64_t batch, int n);
// Every rank's rows of `x` (this rank's share) gathered in rank order: the whole batch, on
// `*to` for the rank that passes one, undefined on the others (a collective: every rank calls it).
// NCCL gathers equal shapes, so each share travels padded to the widest.
at::Tensor gather_batch(Communicator& comm, const at::Tensor& x, std::int64_t batch, int n,
                        const std::optional<c10::Device>& to);

// Refines from step i with output `out`: the ordinary update, reported on rank 0.
at::Tensor refine(Rank& k, int rank, const LoopInputs& in, const at::Tensor& out, int i, const at::Tensor& x);

LoopOutput finish(const Strategy& s, const LoopInputs& in, DeviceGroup& g, at::Tensor latents, int rounds,
                  int evaluations, std::int64_t bytes);

}  // namespace diffract::parallel::detail
