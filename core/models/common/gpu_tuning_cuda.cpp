// The tuning store of each GPU and the counts of what the timed choices cost (gpu_tuning.h).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <nlohmann/json.hpp>
#include <torch/version.h>

#include "core/models/common/gpu_tuning.h"
#include "core/models/common/layers.h"

namespace diffract::models {

namespace {

// The kernel module's version ("580.159.04"): choices timed under one driver may not be the
// fastest, or valid, under another. cudaDriverGetVersion only tells the CUDA version it supports.
std::string driver_version() {
  std::ifstream f("/proc/driver/nvidia/version");
  std::string line;
  if (f && std::getline(f, line)) {
    std::istringstream words(line);
    std::string w, previous;
    while (words >> w) {
      if (previous == "Module") return w;
      previous = w;
    }
  }
  int v = 0;
  cudaDriverGetVersion(&v);
  return "cuda-driver-api-" + std::to_string(v);
}

io::TuningIdentity identity_of(int device) {
  const auto* p = at::cuda::getDeviceProperties(device);
  io::TuningIdentity id;
  id.label = p->name;
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  id.fields = {{"gpu", p->name},
               {"capability", std::to_string(p->major) + "." + std::to_string(p->minor)},
               {"sms", std::to_string(p->multiProcessorCount)},
               {"memory_mib", std::to_string(p->totalGlobalMem >> 20)},
               {"driver", driver_version()},
               {"cuda_runtime", std::to_string(runtime)},
               {"cublaslt", std::to_string(cublasLtGetVersion())},
               {"cudnn", std::to_string(at::detail::getCUDAHooks().versionCuDNN())},
               {"torch", TORCH_VERSION}};
  return id;
}

struct Counts {
  int timed = 0, from_store = 0;
  double ms = 0;
};

std::mutex g_mutex;
std::map<int, io::TuningStore*> g_stores;
std::map<std::string, Counts> g_counts;

}  // namespace

io::TuningStore& tuning_store_for(int device) {
  std::lock_guard lock(g_mutex);
  auto& s = g_stores[device];
  if (!s) s = &io::tuning_store(identity_of(device));
  return *s;
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(stream, &status);
  return status != cudaStreamCaptureStatusNone;
}

void count_tuning(const std::string& kind, bool from_store, double ms) {
  std::lock_guard lock(g_mutex);
  auto& c = g_counts[kind];
  (from_store ? c.from_store : c.timed) += 1;
  c.ms += ms;
}

long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
double ms_between(long long start_ns, long long end_ns) { return static_cast<double>(end_ns - start_ns) / 1e6; }

std::string tuning_stats() {
  std::lock_guard lock(g_mutex);
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [kind, c] : g_counts) j[kind] = {{"timed", c.timed}, {"from_store", c.from_store}, {"ms", c.ms}};
  for (const auto& [device, s] : g_stores)
    j["stores"].push_back({{"device", device}, {"file", s->file().string()}, {"load_problem", s->load_problem()},
                           {"gemm", s->size("gemm")}, {"conv", s->size("conv")}, {"fp8", s->size("fp8")}});
  return j.dump();
}

void save_tuning() { io::save_tuning_stores(); }

}  // namespace diffract::models
