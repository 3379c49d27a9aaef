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
  std::string device = "cpu";  // job::GenerationRequest::device: the model's device (rank 0's)
  int devices = 1;             // job::StrategyParams::devices
  int skip = 2;                // job::StrategyParams::skip, for strategies that take one
  std::vector<int> gpus;       // job::GenerationRequest::gpus: the GPUs in rank order (empty on the CPU)
  std::string error;           // non-empty: the choice cannot run, and why (readable)
};

// The one rule for which devices a job uses, the same for the GUI and the CLI. No GPU enabled
// runs on the CPU with `count` virtual devices (a strategy of a fixed count takes that count).
// With GPUs the job runs on the enabled GPUs in index order, the lowest holding the model: the
// strategy's fixed count, else `gpu_count` of them (0: as many as its device rule allows, e.g.
// every enabled GPU, or the most even number of them for pairs). The GPUs need not be
// consecutive. A strategy that takes a skip factor (step-skip) runs on one device and takes
// `count` as its skip. The registry (core/parallel/registry.h) gives each strategy's rule.
DeviceChoice choose_devices(std::vector<int> enabled_gpus, const std::string& strategy, int count, int gpu_count = 0);

}  // namespace diffract::engine
