#pragma once
// A group of N devices driven from this process: one worker thread per rank, each with its
// own Communicator, running the same function (SPMD).
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "core/parallel/communicator.h"

namespace diffract::parallel {

class DeviceGroup {
 public:
  // N virtual devices: N threads of this process on the CPU, talking through an
  // InProcessCommunicator. What CI runs every strategy on.
  static std::unique_ptr<DeviceGroup> virtual_cpu(int n);
  // "cpu*N" or "virtual:N" (virtual CPU devices). CUDA groups ("cuda:0,cuda:1") need the
  // NCCL communicator and per-GPU model replicas, which are not built yet: an error says so.
  static std::unique_ptr<DeviceGroup> parse(const std::string& spec);

  int size() const { return static_cast<int>(devices_.size()); }
  const c10::Device& device(int rank) const { return devices_.at(static_cast<std::size_t>(rank)); }
  // "cpu:virtual 1", for messages.
  std::string device_name(int rank) const;

  // Runs fn(rank, comm) on every rank's worker and waits for all of them. Each run gets a
  // fresh set of communicators, so a failed run leaves the group usable. The workers run
  // under at::NoGradGuard. The first exception on any rank aborts the communicators (ranks
  // blocked in collectives are released) and is rethrown here: engine::Cancelled as is,
  // anything else as diffract::Error "device <rank> (<name>): <message>".
  void run(const std::function<void(int rank, Communicator& comm)>& fn);

 private:
  explicit DeviceGroup(std::vector<c10::Device> devices) : devices_(std::move(devices)) {}
  std::vector<c10::Device> devices_;
};

}  // namespace diffract::parallel
