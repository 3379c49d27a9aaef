#include "core/engine/devices.h"

#include <algorithm>

#include <torch/cuda.h>

#include "core/parallel/registry.h"

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

DeviceChoice choose_devices(std::vector<int> enabled_gpus, const std::string& strategy, int count, int gpu_count) {
  DeviceChoice c;
  const auto* info = parallel::find_strategy(strategy);
  if (!info) {
    c.error = "unknown strategy '" + strategy.substr(0, 80) + "'";
    return c;
  }
  const auto& rule = info->devices;
  const std::string name(info->name);
  if (info->takes(parallel::Param::Skip)) c.skip = std::max(1, count);
  std::sort(enabled_gpus.begin(), enabled_gpus.end());
  enabled_gpus.erase(std::unique(enabled_gpus.begin(), enabled_gpus.end()), enabled_gpus.end());
  if (enabled_gpus.empty()) {
    c.device = "cpu";
    c.devices = rule.fixed > 0 ? rule.fixed : std::max(1, count);
    if (!rule.allows(c.devices))
      c.error = "strategy " + name + " needs " + rule.describe() + "; " + std::to_string(c.devices) +
                " virtual device(s) asked for";
    return c;
  }
  const int enabled = static_cast<int>(enabled_gpus.size());
  c.device = "cuda:" + std::to_string(enabled_gpus.front());
  const int needed = rule.fixed > 0 ? rule.fixed : gpu_count > 0 ? gpu_count : rule.most_of(enabled);
  if (needed < 1 || needed > enabled || !rule.allows(needed)) {
    c.error = "strategy " + name + " needs " + rule.describe() + "; " + std::to_string(enabled) +
              (enabled == 1 ? " GPU is" : " GPUs are") + " enabled" +
              (gpu_count > 0 ? " and " + std::to_string(gpu_count) + " asked for" : "") +
              " (enable another GPU, or choose single)";
    return c;
  }
  c.devices = needed;
  c.gpus.assign(enabled_gpus.begin(), enabled_gpus.begin() + needed);
  return c;
}

}  // namespace diffract::engine
