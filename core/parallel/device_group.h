#pragma once
// A group of N devices driven from this process: one worker thread per rank, each with its
// own Communicator, running the same function (SPMD).
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>

#include "core/parallel/communicator.h"
#include "core/util/error.h"

namespace diffract::parallel {

// A rank of a group ran out of device memory: "device <rank> (<name>): <the allocator's first
// line>". The pipeline reports it as it reports its own device running out, naming this device.
class DeviceOutOfMemory : public Error {
 public:
  DeviceOutOfMemory(std::string device, std::string why, const std::string& message)
      : Error(message), device_(std::move(device)), why_(std::move(why)) {}
  const std::string& device() const { return device_; }  // "cuda:1", "cpu:virtual 1"
  const std::string& why() const { return why_; }        // "CUDA out of memory. Tried to allocate ..."

 private:
  std::string device_, why_;
};

class DeviceGroup {
 public:
  // N virtual devices: N threads of this process on the CPU, talking through an
  // InProcessCommunicator. What CI runs every strategy on.
  static std::unique_ptr<DeviceGroup> virtual_cpu(int n);
  // One rank per listed GPU, each worker bound to its device, talking through NCCL. The
  // communicators live as long as the group, and are rebuilt after a failed run.
  static std::unique_ptr<DeviceGroup> cuda(const std::vector<int>& devices);
  // "cpu*N" or "virtual:N" (virtual CPU devices), or "cuda:0,cuda:1,..." (NCCL).
  static std::unique_ptr<DeviceGroup> parse(const std::string& spec);

  int size() const { return static_cast<int>(devices_.size()); }
  const c10::Device& device(int rank) const { return devices_.at(static_cast<std::size_t>(rank)); }
  // "cpu:virtual 1", for messages.
  std::string device_name(int rank) const;

  // Runs fn(rank, comm) on every rank's worker and waits for all of them. A rank's worker is the
  // same thread for the group's whole life: cuDNN keeps its execution plans per thread, and on
  // fresh threads each job every eager convolution plans again (AsyncDiff's first SDXL step
  // measured many times slower, docs/benchmarks.md). Virtual groups get
  // fresh communicators each run; NCCL ones keep theirs until a run fails. Either way a failed
  // run leaves the group usable. The workers run under at::NoGradGuard, bound to their device. The first exception on any rank aborts the communicators (ranks
  // blocked in collectives are released) and is rethrown here: job::Cancelled as is, running out
  // of memory as DeviceOutOfMemory, anything else as diffract::Error "device <rank> (<name>):
  // <message>" (LibTorch's messages without their C++ backtrace).
  void run(const std::function<void(int rank, Communicator& comm)>& fn);

  // Runs f() on rank `rank`'s worker thread (no communicator) and waits; rethrows what it throws.
  // For per-rank work that must happen on that thread, such as warming a rank's convolutions.
  void run_on(int rank, const std::function<void()>& f);

  // True the first time `key` is asked about on this group: what a caller did once per group
  // (the pipeline warms a strategy's shapes on every rank once, not before every job).
  bool first_use(const std::string& key) { return used_.insert(key).second; }

 private:
  using Comms = std::vector<std::unique_ptr<Communicator>>;
  DeviceGroup(std::vector<c10::Device> devices, std::function<Comms()> make, bool keep);
  struct Workers;
  std::vector<c10::Device> devices_;
  std::function<Comms()> make_comms_;
  bool keep_comms_ = false;
  Comms comms_;
  std::set<std::string> used_;
  std::unique_ptr<Workers> workers_;  // last: its threads stop before the rest goes

 public:
  ~DeviceGroup();
};

}  // namespace diffract::parallel
