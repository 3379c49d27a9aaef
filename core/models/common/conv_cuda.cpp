// Convolutions on CUDA with a cuDNN plan chosen per DIFFRACT_CONV_TUNING (layers.h,
// models::conv2d). ATen's benchmark mode times up to ten of cuDNN's plans for every new shape and
// keeps the result for the process only: on an H100, SDXL's first job at a new size spent
// 1.5-1.8 s more than later ones, and its step was no faster than with cuDNN's heuristic plans.
//   heuristic (the default): cuDNN's heuristic plan, built in milliseconds, untimed.
//   timed: a shape's first call (in the eager warm-up before a graph capture) times the heuristic
//     plan against the benchmarked one and keeps the benchmarked plan only where it is clearly
//     faster; the choice goes to the GPU's tuning store (gpu_tuning.h), so a later process
//     benchmarks only the shapes that gained. Measured on SDXL (H100, docs/benchmarks.md): 24 of
//     192 shapes kept the benchmarked plan, 2.4 % of the UNet's convolution time.
//   benchmark: at::conv2d under ATen's benchmark mode, which the pipelines switch on.
// With ATen's benchmark flag off (at::globalContext().benchmarkCuDNN(), as DeviceGroup sets it
// while GPU ranks wait on each other), `timed` takes the heuristic plan untimed where it has no
// stored heuristic choice.
//
// The two plans live side by side in ATen's plan cache because the heuristic one is asked for
// with allow_tf32 off, part of the cache key; for bf16 and fp16 that flag selects nothing else.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <nlohmann/json.hpp>

#include "core/models/common/gpu_timing.h"
#include "core/models/common/gpu_tuning.h"
#include "core/models/common/layers.h"
#include "core/util/graphed_function.h"
#include "core/util/options.h"

namespace diffract::models {

bool tuned_conv2d_cuda(const at::Tensor& x, const at::Tensor& w, int64_t stride, int64_t padding, at::Tensor& out);

namespace {

// The benchmarked plan is kept where it saves at least this share of the heuristic plan's time
// and this many ms per call; otherwise the heuristic plan, free to rebuild, wins.
constexpr double kMinGainShare = 0.03, kMinGainMs = 0.005;

struct Shape {
  int device;
  std::int64_t n, c, h, w, k, kh, kw, stride, padding;
  at::ScalarType dtype;
  bool channels_last;
  auto tie() const { return std::tie(device, n, c, h, w, k, kh, kw, stride, padding, dtype, channels_last); }
  bool operator<(const Shape& o) const { return tie() < o.tie(); }
};

struct Choice {
  bool benchmark = false;
  double heuristic_ms = 0, benchmark_ms = 0;
};

std::mutex g_mutex;
std::map<Shape, Choice> g_choices;

std::string store_key(const Shape& s) {
  return std::to_string(s.n) + "x" + std::to_string(s.c) + "x" + std::to_string(s.h) + "x" + std::to_string(s.w) +
         " -> " + std::to_string(s.k) + " k" + std::to_string(s.kh) + "x" + std::to_string(s.kw) + " s" +
         std::to_string(s.stride) + " p" + std::to_string(s.padding) + " " + c10::toString(s.dtype) +
         (s.channels_last ? " channels-last" : "");
}

at::Tensor run(const at::Tensor& x, const at::Tensor& w, int64_t stride, int64_t padding, bool benchmark) {
  return at::cudnn_convolution(x, w, {padding, padding}, {stride, stride}, {1, 1}, 1, benchmark, /*deterministic=*/false,
                               /*allow_tf32=*/benchmark);
}

}  // namespace

bool tuned_conv2d_cuda(const at::Tensor& x, const at::Tensor& w, int64_t stride, int64_t padding, at::Tensor& out) {
  const auto dtype = x.scalar_type();
  if ((dtype != at::kBFloat16 && dtype != at::kHalf) || w.scalar_type() != dtype || w.dim() != 4 ||
      w.size(1) != x.size(1) || x.numel() == 0)
    return false;
  auto& ctx = at::globalContext();
  if (!ctx.userEnabledCuDNN() || ctx.deterministicCuDNN()) return false;
  // Process scope: read once, not on every convolution of an eager forward.
  static const std::string mode = options::value(options::Id::ConvTuning);
  if (mode == "benchmark") return false;  // at::conv2d with ATen's benchmark mode, as the pipelines set it
  const c10::cuda::CUDAGuard guard(x.device());
  if (mode == "heuristic") {
    out = run(x, w, stride, padding, false);
    return true;
  }
  const auto stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const bool channels_last = x.suggest_memory_format() == at::MemoryFormat::ChannelsLast ||
                             w.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
  const Shape s{x.device().index(), x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3),
                stride, padding, dtype, channels_last};
  Choice choice;  // the heuristic plan unless a choice says otherwise
  bool heuristic_only = false;
  at::Tensor made;  // the output, where making the choice already ran this call's convolution
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_choices.find(s);
    if (it == g_choices.end()) {
      if (capturing(stream)) {
        note_unprepared_in_capture();
        return false;  // no timing inside a capture: ATen's path
      }
      auto& store = tuning_store_for(s.device);
      const auto key = store_key(s);
      const auto t0 = now_ns();
      Choice c;
      bool stored = false;
      if (const auto r = store.find("conv", key)) {
        try {
          const auto plan = r->at("plan").get<std::string>();
          if (plan == "heuristic" || plan == "benchmark") {
            c.benchmark = plan == "benchmark";
            c.heuristic_ms = r->at("heuristic_ms").get<double>();
            c.benchmark_ms = r->at("benchmark_ms").get<double>();
            stored = true;
          }
        } catch (const std::exception&) {
        }
      }
      if (!ctx.benchmarkCuDNN() && (!stored || c.benchmark)) {
        // Autotuning is off for now (DeviceGroup turns it off while GPU ranks wait on each other
        // in collectives, and timing or benchmarking synchronises): the heuristic plan, neither
        // timed nor remembered, so that a later job with autotuning on still tunes this shape.
        heuristic_only = true;
      } else if (stored) {
        made = run(x, w, stride, padding, c.benchmark);  // builds (or benchmarks) its plan, counted below
      } else {
        c.heuristic_ms = time_ms(stream, [&] { run(x, w, stride, padding, false); });
        c.benchmark_ms = time_ms(stream, [&] { run(x, w, stride, padding, true); });
        c.benchmark = c.benchmark_ms < c.heuristic_ms * (1 - kMinGainShare) && c.heuristic_ms - c.benchmark_ms >= kMinGainMs;
        store.put("conv", key, {{"plan", c.benchmark ? "benchmark" : "heuristic"}, {"heuristic_ms", c.heuristic_ms},
                                {"benchmark_ms", c.benchmark_ms}});
      }
      if (!heuristic_only) {
        count_tuning("conv", stored, ms_between(t0, now_ns()));
        it = g_choices.emplace(s, c).first;
      }
    }
    if (!heuristic_only) choice = it->second;
  }
  out = made.defined() ? made : run(x, w, stride, padding, choice.benchmark);
  return true;
}

std::string conv_tuning_report() {
  std::lock_guard<std::mutex> lock(g_mutex);
  nlohmann::json j = nlohmann::json::array();
  for (const auto& [s, c] : g_choices)
    j.push_back({{"shape", store_key(s)}, {"heuristic_ms", c.heuristic_ms}, {"benchmark_ms", c.benchmark_ms},
                 {"plan", c.benchmark ? "benchmark" : "heuristic"}});
  return j.dump();
}

}  // namespace diffract::models
