#pragma once
// Collective communication between the ranks of a device group.
//
// Every rank of a group holds one Communicator; all ranks call the collectives in the same
// order (SPMD). Two implementations:
//  - InProcessCommunicator: N "virtual devices" that are threads of this process exchanging
//    CPU tensors through a shared rendezvous. Every strategy runs on it in CI.
//  - NcclCommunicator (communicator_nccl.cpp): one rank per GPU of this process, created
//    together by ncclCommInitAll, collectives enqueued on a communication stream of its own
//    that waits on (and is waited on by) the rank's compute stream through CUDA events.
// Spanning hosts later: ranks would be (host, local GPU) pairs; an NCCL communicator would be
// built from an ncclUniqueId handed out by rank 0 over a side channel (TCP) with
// ncclCommInitRank instead of ncclCommInitAll, and abort() would use ncclCommAbort. Nothing in
// the strategies assumes the ranks share an address space: they only exchange tensors through
// this interface, and every rank replays the same sampler arithmetic on what it receives.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/util/error.h"

namespace diffract::parallel {

// Thrown on the ranks still waiting in a collective when another rank failed (see abort()).
class Aborted : public Error {
 public:
  using Error::Error;
};

// A non-blocking all_gather in flight (Communicator::all_gather_async). It keeps the input and
// the output buffers alive until it is destroyed; destroying it unwaited is allowed (the
// collective still completes on every rank, its result is dropped).
class PendingGather {
 public:
  virtual ~PendingGather();
  // Every rank's tensor, indexed by rank, as all_gather returns them; call once. On a GPU the
  // caller's current stream is made to wait for the gather (the host does not block). Throws
  // Aborted once the group was aborted (see Communicator::abort()), whether or not the gather
  // had completed.
  virtual std::vector<at::Tensor> wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator();
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Every rank's tensor, indexed by rank. An undefined tensor is allowed (a rank with nothing
  // to contribute this round) in-process; NCCL will need equal shapes and dtypes on all ranks.
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& t) = 0;
  // all_gather without waiting for it: a collective like the others (every rank calls it in the
  // same order among all the collectives), started now, its result taken by wait(). NCCL
  // enqueues it on the communication stream after the current stream's work so far and returns
  // at once; the compute stream only waits in wait(). In-process it completes at the call. The
  // default runs all_gather at the call. Counted in bytes_sent() at the call. The caller must
  // not write `t` before wait() (NCCL may read it in place).
  virtual std::unique_ptr<PendingGather> all_gather_async(const at::Tensor& t);
  // all_gather into `out`, a buffer the caller keeps (fixed addresses, e.g. read by a CUDA graph):
  // out [size(), ...] contiguous, t's dtype, size() times t's elements; out[r] becomes rank r's t
  // (its own included). NCCL writes it in place on the communication stream, which the current
  // stream then waits for; the default runs all_gather and copies. Throws diffract::Error
  // naming the mismatch for any other `out`.
  virtual void all_gather_into(const at::Tensor& t, const at::Tensor& out);
  // chunks[d] to rank d (size() chunks; for each d one shape on every rank, as NCCL needs: the
  // chunk this rank sends to d is shaped as d's own chunks[d]); returns the chunk each rank sent
  // to this one, by rank (its own a copy). The in-process and NCCL communicators move each chunk
  // once (NCCL: grouped sends and receives, one launch); the default, for any other, runs one
  // all_gather per destination, size() times those bytes.
  virtual std::vector<at::Tensor> all_to_all(const std::vector<at::Tensor>& chunks);
  // Root's tensor on every rank (others pass anything, e.g. an undefined tensor).
  virtual at::Tensor broadcast(const at::Tensor& t, int root) = 0;
  // Point to point. recv fills `out`, which must have the sent tensor's shape and dtype (as
  // NCCL needs); in-process the sent tensor is copied into it.
  virtual void send(const at::Tensor& t, int dst) = 0;
  virtual void recv(at::Tensor& out, int src) = 0;
  virtual void barrier() = 0;
  // Called by a failing rank: every pending and later collective on every rank throws
  // Aborted carrying `reason`, so no rank stays blocked.
  virtual void abort(const std::string& reason) = 0;
  // Bytes this rank has contributed to collectives and sends so far (statistics).
  virtual std::int64_t bytes_sent() const = 0;
};

// N communicators over one shared in-process rendezvous; element r is rank r's. Tensors are
// copied on the way in (a rank may overwrite its tensor after the call) and returned on the
// CPU device they came from.
std::vector<std::unique_ptr<Communicator>> make_in_process_group(int size);

namespace detail {
// Throws diffract::Error naming the shapes unless `out` can take `size` ranks' `t` (all_gather_into).
void check_gather_buffer(const at::Tensor& t, const at::Tensor& out, int size);
}  // namespace detail

// One rank per listed CUDA device, created together by ncclCommInitAll. Collectives need a
// defined tensor of the same shape and dtype on every rank (broadcast too); each runs on the
// rank's communication stream, ordered after the work already on the device's current stream,
// which then waits for it. Throws diffract::Error when this build has no NCCL.
std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& cuda_devices);
bool nccl_available();

}  // namespace diffract::parallel
