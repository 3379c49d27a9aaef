// The NCCL communicator: built only when CMake found NCCL (DIFFRACT_HAS_NCCL).
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <shared_mutex>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include "core/parallel/communicator.h"
#include "core/util/log.h"
#include "core/util/options.h"

namespace diffract::parallel {

namespace {

void check(ncclResult_t r, const std::string& what) {
  if (r != ncclSuccess) throw Error("NCCL " + what + ": " + ncclGetErrorString(r));
}

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kDouble: return ncclFloat64;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: throw Error(std::string("NCCL cannot carry tensors of type ") + c10::toString(t));
  }
}

// DIFFRACT_NCCL_TRACE=1 logs every operation as it is enqueued (rank, operation, peer, bytes);
// =sync also waits for each to finish on the device and logs that, so that a hang shows which
// operation of which rank never completes. For diagnosis: sync serialises the communication.
int trace_level() {
  static const int level = [] {
    const auto v = options::value(options::Id::NcclTrace);
    return v == "sync" ? 2 : v == "1" ? 1 : 0;
  }();
  return level;
}

// The communicators of one ncclCommInitAll, shared by the ranks' objects.
struct NcclShared {
  std::vector<int> devices;
  std::vector<ncclComm_t> comms;
  // Launches hold it shared (ranks launch at once: a first collective blocks until its peers
  // join); abort() takes it exclusively so it never frees a communicator under a launch.
  std::shared_timed_mutex mutex;
  std::atomic<bool> aborted{false};
  std::string reason;

  ~NcclShared() {
    if (aborted) return;  // abort() already released them
    for (auto c : comms) ncclCommDestroy(c);
  }
};

// An all_gather enqueued on the communication stream: `done` is recorded there after it. The
// buffers were record_stream'ed on that stream, so even a handle destroyed unwaited cannot let
// the caching allocator hand their memory to the compute stream before the gather is through.
class NcclPendingGather final : public PendingGather {
 public:
  NcclPendingGather(std::shared_ptr<NcclShared> s, at::Device device, at::Tensor send, at::Tensor recv,
                    at::cuda::CUDAEvent done)
      : s_(std::move(s)), device_(device), send_(std::move(send)), recv_(std::move(recv)), done_(std::move(done)) {}

  std::vector<at::Tensor> wait() override {
    if (s_->aborted) throw Aborted("aborted: " + s_->reason);
    if (!recv_.defined()) throw Error("NCCL all_gather_async: wait() called twice");
    c10::cuda::CUDAGuard guard(device_);
    done_.block(c10::cuda::getCurrentCUDAStream(device_.index()));
    send_ = at::Tensor();
    auto parts = recv_.unbind(0);
    recv_ = at::Tensor();
    return {parts.begin(), parts.end()};
  }

 private:
  std::shared_ptr<NcclShared> s_;
  at::Device device_;
  at::Tensor send_, recv_;
  at::cuda::CUDAEvent done_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclShared> s, int rank)
      : s_(std::move(s)), rank_(rank), device_(at::kCUDA, static_cast<c10::DeviceIndex>(s_->devices[static_cast<std::size_t>(rank)])),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_.index())) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(s_->devices.size()); }

  std::vector<at::Tensor> all_gather(const at::Tensor& t) override {
    auto send = prepare(t, "all_gather");
    send.record_stream(stream_);  // as in send(): a copy may be freed before the stream has read it
    std::vector<int64_t> shape{size()};
    for (auto d : send.sizes()) shape.push_back(d);
    auto recv = at::empty(shape, send.options());
    enqueue([&] {
      check(ncclAllGather(send.data_ptr(), recv.data_ptr(), static_cast<size_t>(send.numel()), nccl_type(send.scalar_type()),
                          comm(), stream_.stream()),
            "all_gather");
    }, "all_gather", -1, static_cast<std::int64_t>(send.nbytes()));
    bytes_ += static_cast<std::int64_t>(send.nbytes());
    auto parts = recv.unbind(0);
    return {parts.begin(), parts.end()};
  }

  // As all_gather, but the compute stream does not wait for it here: the handle's wait() does.
  std::unique_ptr<PendingGather> all_gather_async(const at::Tensor& t) override {
    auto send = prepare(t, "all_gather_async");
    send.record_stream(stream_);
    std::vector<int64_t> shape{size()};
    for (auto d : send.sizes()) shape.push_back(d);
    at::Tensor recv;
    {
      c10::cuda::CUDAGuard guard(device_);
      recv = at::empty(shape, send.options());  // on the compute stream: written on the communication one
    }
    recv.record_stream(stream_);
    at::cuda::CUDAEvent done;
    enqueue([&] {
      check(ncclAllGather(send.data_ptr(), recv.data_ptr(), static_cast<size_t>(send.numel()), nccl_type(send.scalar_type()),
                          comm(), stream_.stream()),
            "all_gather_async");
    }, "all_gather_async", -1, static_cast<std::int64_t>(send.nbytes()), &done);
    bytes_ += static_cast<std::int64_t>(send.nbytes());
    return std::make_unique<NcclPendingGather>(s_, device_, std::move(send), std::move(recv), std::move(done));
  }

  void all_gather_into(const at::Tensor& t, const at::Tensor& out) override {
    detail::check_gather_buffer(t, out, size());
    if (!out.is_cuda() || out.device() != device_) throw Error("NCCL all_gather_into needs an output buffer on " + device_.str());
    auto send = prepare(t, "all_gather_into");
    send.record_stream(stream_);
    enqueue([&] {
      check(ncclAllGather(send.data_ptr(), out.data_ptr(), static_cast<size_t>(send.numel()), nccl_type(send.scalar_type()),
                          comm(), stream_.stream()),
            "all_gather_into");
    }, "all_gather_into", -1, static_cast<std::int64_t>(send.nbytes()));
    bytes_ += static_cast<std::int64_t>(send.nbytes());
  }

  at::Tensor broadcast(const at::Tensor& t, int root) override {
    check_rank(root, "broadcast root");
    auto buf = prepare(t, "broadcast").clone();
    enqueue([&] {
      check(ncclBroadcast(buf.data_ptr(), buf.data_ptr(), static_cast<size_t>(buf.numel()), nccl_type(buf.scalar_type()),
                          root, comm(), stream_.stream()),
            "broadcast");
    }, "broadcast", root, static_cast<std::int64_t>(buf.nbytes()));
    if (rank_ == root) bytes_ += static_cast<std::int64_t>(buf.nbytes());
    return buf;
  }

  void send(const at::Tensor& t, int dst) override {
    check_rank(dst, "send destination");
    auto buf = prepare(t, "send");
    // A copy made by prepare() is freed when this returns, while the send may still read it on
    // the communication stream: the allocator must not hand its memory out before then.
    buf.record_stream(stream_);
    enqueue([&] {
      check(ncclSend(buf.data_ptr(), static_cast<size_t>(buf.numel()), nccl_type(buf.scalar_type()), dst, comm(),
                     stream_.stream()),
            "send");
    }, "send", dst, static_cast<std::int64_t>(buf.nbytes()));
    bytes_ += static_cast<std::int64_t>(buf.nbytes());
  }

  void recv(at::Tensor& out, int src) override {
    check_rank(src, "recv source");
    if (!out.defined() || !out.is_cuda() || out.device() != device_)
      throw Error("NCCL recv needs a tensor on " + device_.str());
    // send() moves the values in contiguous order; a channels-last `out` (the UNet's activations
    // when it runs channels-last) takes them through a contiguous buffer.
    auto buf = out.is_contiguous() ? out : at::empty(out.sizes(), out.options());
    buf.record_stream(stream_);
    enqueue([&] {
      check(ncclRecv(buf.data_ptr(), static_cast<size_t>(buf.numel()), nccl_type(buf.scalar_type()), src, comm(),
                     stream_.stream()),
            "recv");
    }, "recv", src, static_cast<std::int64_t>(buf.nbytes()));
    if (!buf.is_same(out)) out.copy_(buf);  // on the compute stream, which waits for the receive
  }

  // Grouped ncclSend / ncclRecv with every peer, one launch on the communication stream.
  std::vector<at::Tensor> all_to_all(const std::vector<at::Tensor>& chunks) override {
    if (static_cast<int>(chunks.size()) != size())
      throw Error("all_to_all: " + std::to_string(chunks.size()) + " chunks for " + std::to_string(size()) + " ranks");
    std::vector<at::Tensor> sends, got(static_cast<std::size_t>(size()));
    for (const auto& c : chunks) sends.push_back(prepare(c, "all_to_all"));
    const auto& mine = sends[static_cast<std::size_t>(rank_)];
    std::int64_t bytes = 0;
    for (int d = 0; d < size(); ++d) {
      if (d == rank_) continue;
      auto& out = got[static_cast<std::size_t>(d)];
      out = at::empty(mine.sizes(), mine.options());  // on the compute stream: written on the communication one
      out.record_stream(stream_);
      sends[static_cast<std::size_t>(d)].record_stream(stream_);
      bytes += static_cast<std::int64_t>(sends[static_cast<std::size_t>(d)].nbytes());
    }
    enqueue([&] {
      check(ncclGroupStart(), "all_to_all group start");
      for (int d = 0; d < size(); ++d) {
        if (d == rank_) continue;
        const auto& t = sends[static_cast<std::size_t>(d)];
        const auto& out = got[static_cast<std::size_t>(d)];
        check(ncclSend(t.data_ptr(), static_cast<size_t>(t.numel()), nccl_type(t.scalar_type()), d, comm(),
                       stream_.stream()),
              "all_to_all send");
        check(ncclRecv(out.data_ptr(), static_cast<size_t>(out.numel()), nccl_type(out.scalar_type()), d, comm(),
                       stream_.stream()),
              "all_to_all recv");
      }
      check(ncclGroupEnd(), "all_to_all group end");
    }, "all_to_all", -1, bytes);
    bytes_ += bytes;
    got[static_cast<std::size_t>(rank_)] = mine.clone();
    return got;
  }

  void barrier() override {
    auto one = at::ones({1}, at::TensorOptions().device(device_));
    enqueue([&] {
      check(ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclFloat32, ncclSum, comm(), stream_.stream()), "barrier");
    }, "barrier");
    stream_.synchronize();
  }

  void abort(const std::string& reason) override {
    if (s_->aborted.exchange(true)) return;
    s_->reason = reason;
    // A rank stuck inside a launch (waiting for a peer that will never come) holds the lock;
    // after a grace period the abort goes ahead anyway, since it is what releases that rank.
    std::unique_lock<std::shared_timed_mutex> lock(s_->mutex, std::defer_lock);
    (void)lock.try_lock_for(std::chrono::seconds(2));
    for (auto c : s_->comms) ncclCommAbort(c);
  }

  std::int64_t bytes_sent() const override { return bytes_; }

 private:
  ncclComm_t comm() const { return s_->comms[static_cast<std::size_t>(rank_)]; }

  void check_rank(int r, const char* what) const {
    if (r < 0 || r >= size())
      throw Error(std::string(what) + " " + std::to_string(r) + " is not a rank of this group of " + std::to_string(size()));
  }

  at::Tensor prepare(const at::Tensor& t, const char* what) {
    if (!t.defined()) throw Error(std::string("NCCL ") + what + " needs a tensor on every rank");
    return t.to(device_).contiguous();
  }

  // The collective runs on the communication stream after the compute stream's work so far;
  // the compute stream's later work waits for it, or, given `done`, the event recorded after it
  // goes there instead (all_gather_async: the compute stream waits in its wait()). Launches hold
  // the group's lock so that abort() never frees a communicator under one.
  template <class F>
  void enqueue(F&& launch, const char* op = "", int peer = -1, std::int64_t bytes = 0,
               at::cuda::CUDAEvent* done = nullptr) {
    std::shared_lock<std::shared_timed_mutex> lock(s_->mutex);
    if (s_->aborted) throw Aborted("aborted: " + s_->reason);
    c10::cuda::CUDAGuard guard(device_);
    const auto compute = c10::cuda::getCurrentCUDAStream(device_.index());
    at::cuda::CUDAEvent before, after;
    before.record(compute);
    before.block(stream_);
    const int trace = trace_level();
    if (trace) log::get("nccl").info(log::str("rank ", rank_, " enqueues ", op, " peer ", peer, ", ", bytes, " bytes"));
    launch();
    after.record(stream_);
    if (done) *done = std::move(after);
    else after.block(compute);
    if (trace == 2) {
      stream_.synchronize();
      log::get("nccl").info(log::str("rank ", rank_, " finished ", op));
    }
  }

  std::shared_ptr<NcclShared> s_;
  int rank_;
  at::Device device_;
  c10::cuda::CUDAStream stream_;
  std::int64_t bytes_ = 0;
};

}  // namespace

bool nccl_available() { return true; }

std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& cuda_devices) {
  if (cuda_devices.empty()) throw Error("an NCCL group needs at least one CUDA device");
  auto s = std::make_shared<NcclShared>();
  s->devices = cuda_devices;
  s->comms.resize(cuda_devices.size());
  check(ncclCommInitAll(s->comms.data(), static_cast<int>(cuda_devices.size()), cuda_devices.data()), "init");
  // One all-reduce from this thread over every rank, grouped: NCCL connects the ranks on their
  // first collective, and that must not happen later with each rank on its own thread waiting
  // for the others.
  std::vector<at::Tensor> probes;
  check(ncclGroupStart(), "group start");
  for (std::size_t r = 0; r < cuda_devices.size(); ++r) {
    const at::Device d(at::kCUDA, static_cast<c10::DeviceIndex>(cuda_devices[r]));
    c10::cuda::CUDAGuard guard(d);
    probes.push_back(at::ones({1}, at::TensorOptions().device(d)));
    check(ncclAllReduce(probes.back().data_ptr(), probes.back().data_ptr(), 1, ncclFloat32, ncclSum, s->comms[r],
                        c10::cuda::getCurrentCUDAStream(d.index()).stream()),
          "first all-reduce");
  }
  check(ncclGroupEnd(), "group end");
  for (auto& p : probes)
    if (p.item<float>() != static_cast<float>(cuda_devices.size())) throw Error("NCCL: the first all-reduce gave a wrong sum");
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < static_cast<int>(cuda_devices.size()); ++r) out.push_back(std::make_unique<NcclCommunicator>(s, r));
  return out;
}

}  // namespace diffract::parallel
