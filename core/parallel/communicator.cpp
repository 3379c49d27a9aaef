#include "core/parallel/communicator.h"

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>

#include <ATen/ATen.h>

namespace diffract::parallel {

Communicator::~Communicator() = default;
PendingGather::~PendingGather() = default;

namespace {

// A gather completed at the call; wait() hands its result over after `check` (when given),
// which throws Aborted if the group was aborted since.
class CompletedGather final : public PendingGather {
 public:
  CompletedGather(std::vector<at::Tensor> parts, std::function<void()> check)
      : parts_(std::move(parts)), check_(std::move(check)) {}
  std::vector<at::Tensor> wait() override {
    if (check_) check_();
    return std::move(parts_);
  }

 private:
  std::vector<at::Tensor> parts_;
  std::function<void()> check_;
};

}  // namespace

std::unique_ptr<PendingGather> Communicator::all_gather_async(const at::Tensor& t) {
  return std::make_unique<CompletedGather>(all_gather(t), nullptr);
}

void detail::check_gather_buffer(const at::Tensor& t, const at::Tensor& out, int size) {
  if (!t.defined() || !out.defined()) throw Error("all_gather_into needs a tensor and an output buffer");
  if (!out.is_contiguous() || out.dim() < 1 || out.size(0) != size || out.scalar_type() != t.scalar_type() ||
      out.numel() != t.numel() * size)
    throw Error("all_gather_into: the output buffer " + std::string(c10::toString(out.scalar_type())) + " " +
                c10::str(out.sizes()) + (out.is_contiguous() ? "" : " (not contiguous)") + " cannot hold " +
                std::to_string(size) + " ranks' " + c10::toString(t.scalar_type()) + " " + c10::str(t.sizes()));
}

std::vector<at::Tensor> Communicator::all_to_all(const std::vector<at::Tensor>& chunks) {
  if (static_cast<int>(chunks.size()) != size())
    throw Error("all_to_all: " + std::to_string(chunks.size()) + " chunks for " + std::to_string(size()) + " ranks");
  std::vector<at::Tensor> mine;
  for (int d = 0; d < size(); ++d) {
    auto gathered = all_gather(chunks[static_cast<std::size_t>(d)]);
    if (d == rank()) mine = std::move(gathered);
  }
  return mine;
}

void Communicator::all_gather_into(const at::Tensor& t, const at::Tensor& out) {
  detail::check_gather_buffer(t, out, size());
  auto parts = all_gather(t);
  for (std::size_t r = 0; r < parts.size(); ++r) out[static_cast<std::int64_t>(r)].view_as(parts[r]).copy_(parts[r]);
}

namespace {

struct Rendezvous {
  explicit Rendezvous(int n) : size(n), slots(static_cast<std::size_t>(n)) {}
  const int size;
  std::mutex mutex;
  std::condition_variable cv;
  // all_gather: contributions of the collective in progress, and the last completed one.
  std::vector<at::Tensor> slots;
  std::vector<at::Tensor> published;
  int arrived = 0;
  std::uint64_t generation = 0;
  // send / recv mailboxes keyed by (src, dst).
  std::map<std::pair<int, int>, std::deque<at::Tensor>> mail;
  bool aborted = false;
  std::string reason;

  void check() const {
    if (aborted) throw Aborted("aborted: " + reason);
  }
};

at::Tensor copy_in(const at::Tensor& t) { return t.defined() ? t.detach().clone() : at::Tensor(); }

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Rendezvous> r, int rank) : r_(std::move(r)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return r_->size; }

  std::vector<at::Tensor> all_gather(const at::Tensor& t) override {
    auto copy = copy_in(t);
    if (copy.defined()) bytes_ += static_cast<std::int64_t>(copy.nbytes());
    std::unique_lock<std::mutex> lock(r_->mutex);
    r_->check();
    r_->slots[static_cast<std::size_t>(rank_)] = std::move(copy);
    const auto gen = r_->generation;
    if (++r_->arrived == r_->size) {
      r_->published = std::move(r_->slots);
      r_->slots.assign(static_cast<std::size_t>(r_->size), at::Tensor());
      r_->arrived = 0;
      ++r_->generation;
      r_->cv.notify_all();
    } else {
      r_->cv.wait(lock, [&] { return r_->generation != gen || r_->aborted; });
      if (r_->generation == gen) r_->check();
    }
    // The next collective cannot complete before this rank joins it, so `published` is ours.
    // NCCL moves bytes: contributions of different shapes or types would hang or garble it, so
    // they are refused here too, where CI can see them.
    const at::Tensor* first = nullptr;
    for (const auto& t : r_->published) {
      if (!t.defined()) continue;
      if (!first) first = &t;
      else if (t.sizes() != first->sizes() || t.scalar_type() != first->scalar_type())
        throw Error("all_gather: the ranks sent tensors of different shapes or types (" + std::string(c10::toString(first->scalar_type())) +
                    " vs " + c10::toString(t.scalar_type()) + ")");
    }
    return r_->published;
  }

  // Completes at the call (the rendezvous is synchronous); wait() still throws Aborted once the
  // group was aborted, as NCCL's does.
  std::unique_ptr<PendingGather> all_gather_async(const at::Tensor& t) override {
    auto r = r_;
    return std::make_unique<CompletedGather>(all_gather(t), [r] {
      std::lock_guard<std::mutex> lock(r->mutex);
      r->check();
    });
  }

  at::Tensor broadcast(const at::Tensor& t, int root) override {
    check_rank(root, "broadcast root");
    return all_gather(rank_ == root ? t : at::Tensor())[static_cast<std::size_t>(root)];
  }

  void send(const at::Tensor& t, int dst) override {
    check_rank(dst, "send destination");
    auto copy = copy_in(t);
    bytes_ += static_cast<std::int64_t>(copy.nbytes());
    std::lock_guard<std::mutex> lock(r_->mutex);
    r_->check();
    r_->mail[{rank_, dst}].push_back(std::move(copy));
    r_->cv.notify_all();
  }

  void recv(at::Tensor& out, int src) override {
    check_rank(src, "recv source");
    std::unique_lock<std::mutex> lock(r_->mutex);
    auto& box = r_->mail[{src, rank_}];
    r_->cv.wait(lock, [&] { return !box.empty() || r_->aborted; });
    r_->check();
    auto t = std::move(box.front());
    box.pop_front();
    lock.unlock();
    if (!out.defined() || out.sizes() != t.sizes() || out.scalar_type() != t.scalar_type())
      throw Error("recv from rank " + std::to_string(src) + ": expected a tensor shaped like the one sent");
    out.copy_(t);
  }

  // Each chunk once, through the mailboxes: sends never block here, so every rank posts its
  // sends, then takes its receives.
  std::vector<at::Tensor> all_to_all(const std::vector<at::Tensor>& chunks) override {
    if (static_cast<int>(chunks.size()) != size())
      throw Error("all_to_all: " + std::to_string(chunks.size()) + " chunks for " + std::to_string(size()) + " ranks");
    for (int d = 0; d < size(); ++d)
      if (d != rank_) send(chunks[static_cast<std::size_t>(d)], d);
    std::vector<at::Tensor> got(static_cast<std::size_t>(size()));
    const auto& mine = chunks[static_cast<std::size_t>(rank_)];
    for (int s = 0; s < size(); ++s) {
      auto& out = got[static_cast<std::size_t>(s)];
      out = s == rank_ ? copy_in(mine) : at::empty(mine.sizes(), mine.options());
      if (s != rank_) recv(out, s);
    }
    return got;
  }

  void barrier() override { all_gather(at::Tensor()); }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(r_->mutex);
    if (!r_->aborted) {
      r_->aborted = true;
      r_->reason = reason;
    }
    r_->cv.notify_all();
  }

  std::int64_t bytes_sent() const override { return bytes_; }

 private:
  void check_rank(int r, const char* what) const {
    if (r < 0 || r >= r_->size)
      throw Error(std::string(what) + " " + std::to_string(r) + " is not a rank of this group of " +
                  std::to_string(r_->size));
  }
  std::shared_ptr<Rendezvous> r_;
  int rank_;
  std::int64_t bytes_ = 0;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_in_process_group(int size) {
  if (size < 1) throw Error("a communicator group needs at least one rank, not " + std::to_string(size));
  auto r = std::make_shared<Rendezvous>(size);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int i = 0; i < size; ++i) out.push_back(std::make_unique<InProcessCommunicator>(r, i));
  return out;
}

}  // namespace diffract::parallel

#ifndef DIFFRACT_HAS_NCCL
namespace diffract::parallel {
bool nccl_available() { return false; }
std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>&) {
  throw Error("this build of Diffract has no NCCL: multi-GPU groups are unavailable (virtual:N runs on the CPU)");
}
}  // namespace diffract::parallel
#endif
