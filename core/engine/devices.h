#pragma once
// Device discovery and the choice of devices for a job. No torch headers: the GUI includes this.
#include <cstdint>
#include <string>
#include <vector>

namespace diffract::engine {

struct DeviceInfo {
  std::string name;              // e.g. "NVIDIA H200"
  int index = 0;                 // N in "cuda:N"
  std::uint64_t total_bytes = 0;
  std::uint64_t used_bytes = 0;  // in use now, by every process (total minus free)
};

// Every CUDA device this build can use, in index order; empty without CUDA or without a GPU.
std::vector<DeviceInfo> list_devices();

struct DeviceChoice {
  std::string device = "cpu";  // GenerationRequest::device
  int devices = 1;             // GenerationRequest::devices
  std::string error;           // non-empty: the choice cannot run, and why (readable)
};

// Maps the enabled GPUs (indices, any order) and a strategy name to a request's device and
// devices. No GPU enabled runs on the CPU with `cpu_devices` virtual devices. With GPUs the job
// runs on the lowest enabled one; multi-GPU strategies take consecutive GPUs from there
// (cfg-parallel and hybrid-cfg need 2, driffusion, data-parallel, pipefusion and asyncdiff use every
// enabled GPU; asyncdiff-stride2 every one of 3 or more).
// step-skip runs on one device and keeps `cpu_devices` as its skip factor.
DeviceChoice choose_devices(std::vector<int> enabled_gpus, const std::string& strategy, int cpu_devices);

}  // namespace diffract::engine
