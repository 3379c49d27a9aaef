#include "core/engine/devices.h"

#include <algorithm>

#include <torch/cuda.h>

#ifdef DIFFRACT_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>
#endif

namespace diffract::engine {

std::vector<DeviceInfo> list_devices() {
  std::vector<DeviceInfo> out;
#ifdef DIFFRACT_HAS_CUDA
  const int count = static_cast<int>(torch::cuda::device_count());
  int previous = 0;
  if (count > 0 && cudaGetDevice(&previous) != cudaSuccess) previous = 0;
  for (int i = 0; i < count; ++i) {
    DeviceInfo info;
    info.index = i;
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(i);
    info.name = props->name;
    info.total_bytes = props->totalGlobalMem;
    std::size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      info.total_bytes = total_bytes;
      info.used_bytes = total_bytes - free_bytes;
    } else {
      cudaGetLastError();  // leave no sticky error for the next CUDA call on this thread
    }
    out.push_back(std::move(info));
  }
  if (count > 0) cudaSetDevice(previous);
#endif
  return out;
}

namespace {

const char* const kKnown[] = {"single",        "cfg-parallel", "hybrid-cfg", "driffusion", "driffusion-aggressive",
                              "data-parallel", "step-skip",    "pipefusion", "asyncdiff", "cfg-driffusion",
                              "cfg-driffusion-aggressive", "cfg-pipefusion", "distrifusion", "asyncdiff-stride2"};

}  // namespace

DeviceChoice choose_devices(std::vector<int> enabled_gpus, const std::string& strategy, int cpu_devices) {
  DeviceChoice c;
  const std::string name = strategy.empty() ? "single" : strategy;
  if (std::find(std::begin(kKnown), std::end(kKnown), name) == std::end(kKnown)) {
    c.error = "unknown strategy '" + name + "'";
    return c;
  }
  std::sort(enabled_gpus.begin(), enabled_gpus.end());
  enabled_gpus.erase(std::unique(enabled_gpus.begin(), enabled_gpus.end()), enabled_gpus.end());
  if (enabled_gpus.empty()) {
    c.device = "cpu";
    c.devices = std::max(1, cpu_devices);
    return c;
  }
  const int first = enabled_gpus.front();
  const int enabled = static_cast<int>(enabled_gpus.size());
  c.device = "cuda:" + std::to_string(first);
  if (name == "single") {
    c.devices = 1;
    return c;
  }
  if (name == "step-skip") {
    c.devices = std::max(1, cpu_devices);  // the skip factor, on one GPU
    return c;
  }
  // A pair of GPUs per draft (cfg-driffusion) or per stage (cfg-pipefusion: a pipeline per branch).
  const bool pairs = name.rfind("cfg-driffusion", 0) == 0 || name == "cfg-pipefusion";
  const int needed = (name == "cfg-parallel" || name == "hybrid-cfg") ? 2 : pairs ? enabled - enabled % 2 : enabled;
  if (name == "asyncdiff-stride2" && enabled < 3) {  // 2 components, the last on a second GPU too
    c.error = "strategy asyncdiff-stride2 needs 3 GPUs; " + std::to_string(enabled) +
              " enabled (enable another GPU, or choose asyncdiff)";
    return c;
  }
  if (enabled < needed || needed < 1) {
    c.error = "strategy " + name + " needs 2 GPUs; " + std::to_string(enabled) +
              " is enabled (enable another GPU, or choose single)";
    return c;
  }
  // The pipeline runs a strategy on cuda:k, cuda:k+1, ...: the enabled GPUs must be consecutive.
  for (int r = 1; r < needed; ++r)
    if (enabled_gpus[r] != first + r) {
      c.error = "strategy " + name + " runs on consecutive GPUs (cuda:" + std::to_string(first) + ", cuda:" +
                std::to_string(first + 1) + ", ...); cuda:" + std::to_string(first + r) + " is not enabled";
      return c;
    }
  c.devices = needed;
  return c;
}

}  // namespace diffract::engine
