#include "core/pipeline/kernel_profile.h"

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

namespace diffract::pipeline {

double mean_cuda_ms(int reps, const std::function<void()>& f, int device, int warmups) {
  for (int i = 0; i < warmups; ++i) f();
  torch::cuda::synchronize(device);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) f();
  torch::cuda::synchronize(device);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / std::max(reps, 1);
}

nlohmann::json kernel_profile(int reps, const std::function<void()>& f, int device) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const prof::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO, /*report_input_shapes=*/true);
  const std::set<ActivityType> activities{ActivityType::CPU, ActivityType::CUDA};
  f();
  torch::cuda::synchronize(device);
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  for (int i = 0; i < reps; ++i) f();
  torch::cuda::synchronize(device);
  const auto result = prof::disableProfiler();
  std::map<std::string, double> by_name, by_family;
  std::map<std::string, int> calls;
  double total = 0;
  int kernels = 0;
  // The ATen op (and its input shapes) that launched each kernel or memset: which GEMM shape a
  // kernel serves, who sets memory to zero.
  std::map<std::uint64_t, std::string> ops;
  for (const auto& e : result->events()) {
    if (e.deviceType() != c10::DeviceType::CPU || e.name().rfind("aten::", 0) != 0) continue;
    std::string what = e.name();
    if (e.hasShapes()) {
      what += " ";
      for (const auto& shape : e.shapes())
        if (!shape.empty()) what += c10::str(c10::IntArrayRef(shape));
    }
    ops[e.correlationId()] = what;
  }
  std::map<std::string, std::pair<double, int>> by_op;
  auto family = [](std::string n) {
    std::transform(n.begin(), n.end(), n.begin(), [](unsigned char ch) { return std::tolower(ch); });
    auto has = [&](const char* k) { return n.find(k) != std::string::npos; };
    if (has("flash") || has("fmha") || has("attention")) return "attention";
    if (has("conv") || has("fprop") || has("dgrad") || has("wgrad")) return "convolution";
    if (has("gemm") || has("nvjet") || has("xmma") || has("cutlass") || has("matmul")) return "matmul";
    if (has("norm")) return "normalisation";
    if (has("memcpy") || has("memset")) return "copy";
    return "elementwise and other";
  };
  for (const auto& e : result->events()) {
    if (e.deviceType() != c10::DeviceType::CUDA) continue;
    const double ms = static_cast<double>(e.durationNs()) / 1e6 / reps;
    by_name[e.name()] += ms;
    ++calls[e.name()];
    const auto op = ops.find(e.linkedCorrelationId());
    auto& o = by_op[e.name().substr(0, 60) + " <- " + (op == ops.end() ? "?" : op->second)];
    o.first += ms;
    ++o.second;
    by_family[family(e.name())] += ms;
    total += ms;
    ++kernels;
  }
  std::vector<std::pair<double, std::string>> top;
  for (const auto& [n, ms] : by_name) top.emplace_back(ms, n);
  std::sort(top.rbegin(), top.rend());
  nlohmann::json j;
  j["device_ms_per_call"] = total;
  j["kernels_per_call"] = kernels / reps;
  j["families_ms"] = by_family;
  for (std::size_t i = 0; i < std::min<std::size_t>(40, top.size()); ++i)
    j["top_ms"].push_back({top[i].second.substr(0, 120), top[i].first, calls[top[i].second] / reps});
  std::vector<std::pair<double, std::string>> top_ops;
  for (const auto& [n, v] : by_op) top_ops.emplace_back(v.first, n);
  std::sort(top_ops.rbegin(), top_ops.rend());
  for (std::size_t i = 0; i < std::min<std::size_t>(60, top_ops.size()); ++i)
    j["top_by_op"].push_back({top_ops[i].second.substr(0, 240), top_ops[i].first, by_op[top_ops[i].second].second / reps});
  return j;
}

nlohmann::json step_profile(int size, std::int64_t tokens, int reps, const std::function<void()>& eager,
                            const std::function<void()>& graphed, int device) {
  nlohmann::json j;
  j["size"] = size;
  j["tokens"] = tokens;
  j["eager_ms"] = mean_cuda_ms(reps, eager, device);
  j["graph_ms"] = mean_cuda_ms(reps, graphed, device);
  j["kernels"] = kernel_profile(reps, eager, device);
  return j;
}

}  // namespace diffract::pipeline
