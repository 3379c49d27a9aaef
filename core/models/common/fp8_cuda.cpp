// The CUDA side of fp8_linear.h: the activations quantised per token by our kernel, the GEMM by
// at::_scaled_mm with row-wise scales (the e4m3 weight's per channel, the activations' per
// token) and the bias applied in its epilogue, fast fp8 accumulation, bf16 out. Each shape is
// timed on its first call against the layer's bf16 GEMM (models::linear) and keeps the faster;
// the choice goes to the GPU's tuning store (gpu_tuning.h), where a later process finds it.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <nlohmann/json.hpp>

#include "core/models/common/fp8_kernels.h"
#include "core/models/common/fp8_linear.h"
#include "core/models/common/gpu_timing.h"
#include "core/models/common/gpu_tuning.h"
#include "core/util/options.h"
#include "core/models/common/kernel_dtype.h"
#include "core/models/common/layers.h"
#include "core/util/error.h"

namespace diffract::models {

bool fp8_linear_cuda(const at::Tensor& x, Fp8WeightCache& cache, const at::Tensor& weight, const at::Tensor& bias,
                     at::Tensor& out);

namespace {

struct Shape {
  int device;
  std::int64_t m, n, k;
  bool bias;
  bool operator<(const Shape& o) const {
    return std::tie(device, m, n, k, bias) < std::tie(o.device, o.m, o.n, o.k, o.bias);
  }
};

struct Choice {
  bool fp8 = false;
  double bf16_ms = 0, fp8_ms = 0, quant_ms = 0;  // per call, as timed
};

std::mutex g_mutex;
std::map<Shape, Choice> g_choices;

void check(int rc, const char* what) {
  if (rc != 0) throw Error(std::string("fp8 ") + what + ": " + cudaGetErrorString(static_cast<cudaError_t>(rc)));
}

// sm_89 and later have fp8 tensor cores.
bool fp8_capable(int device) {
  static std::mutex mutex;
  static std::map<int, bool> capable;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = capable.find(device);
  if (it == capable.end()) {
    const auto* p = at::cuda::getDeviceProperties(device);
    it = capable.emplace(device, p->major * 10 + p->minor >= 89).first;
  }
  return it->second;
}

std::pair<at::Tensor, at::Tensor> quantize(const at::Tensor& x, cudaStream_t stream) {
  const std::int64_t m = x.size(0), k = x.size(1);
  auto q = at::empty({m, k}, x.options().dtype(at::kFloat8_e4m3fn));
  auto scale = at::empty({m, 1}, x.options().dtype(at::kFloat));
  kernels::QuantizeRowsArgs a;
  a.x = x.data_ptr();
  a.q = q.data_ptr();
  a.scale = scale.data_ptr<float>();
  a.rows = m;
  a.cols = k;
  a.dtype = *kernel_dtype(x.scalar_type());
  check(kernels::quantize_rows_fp8(a, stream), "quantize_rows");
  return {q, scale};
}

at::Tensor run(const at::Tensor& x, const Fp8Weight& w, const at::Tensor& bias, cudaStream_t stream) {
  const auto [q, scale] = quantize(x, stream);
  return at::_scaled_mm(q, w.weight.t(), scale, w.scale, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                        std::nullopt, x.scalar_type(), /*use_fast_accum=*/true);
}

}  // namespace

bool fp8_linear_cuda(const at::Tensor& x, Fp8WeightCache& cache, const at::Tensor& weight, const at::Tensor& bias,
                     at::Tensor& out) {
  // Row-wise scaled GEMMs write bf16 only.
  if (x.scalar_type() != at::kBFloat16 || weight.scalar_type() != at::kBFloat16 ||
      (bias.defined() && bias.scalar_type() != at::kBFloat16) || x.dim() != 2 || !x.is_contiguous())
    return false;
  const int device = x.device().index();
  if (!fp8_capable(device)) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream(device).stream();
  if (options::value(options::Id::Fp8Layers) == "all") {
    out = run(x, *cache.get(weight), bias, stream);
    return true;
  }
  const Shape s{device, x.size(0), weight.size(0), weight.size(1), bias.defined()};
  Choice choice;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_choices.find(s);
    if (it == g_choices.end()) {
      if (capturing(stream)) return false;  // no timing inside a capture: bf16
      auto& store = tuning_store_for(device);
      const auto key = std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k) + (s.bias ? " bias" : "");
      const auto t0 = now_ns();
      Choice c;
      bool stored = false;
      if (const auto r = store.find("fp8", key)) {
        try {
          c.fp8 = r->at("fp8").get<bool>();
          c.bf16_ms = r->at("bf16_ms").get<double>();
          c.fp8_ms = r->at("fp8_ms").get<double>();
          c.quant_ms = r->at("quant_ms").get<double>();
          stored = true;
        } catch (const std::exception&) {
        }
      }
      if (!stored) {
        const auto w = cache.get(weight);
        c.bf16_ms = time_ms(stream, [&] { linear(x, weight, bias); });
        c.quant_ms = time_ms(stream, [&] { quantize(x, stream); });
        c.fp8_ms = time_ms(stream, [&] { run(x, *w, bias, stream); });
        c.fp8 = c.fp8_ms < c.bf16_ms;
        store.put("fp8", key, {{"fp8", c.fp8}, {"bf16_ms", c.bf16_ms}, {"fp8_ms", c.fp8_ms}, {"quant_ms", c.quant_ms}});
      }
      count_tuning("fp8", stored, ms_between(t0, now_ns()));
      it = g_choices.emplace(s, c).first;
    }
    choice = it->second;
  }
  if (!choice.fp8) return false;
  out = run(x, *cache.get(weight), bias, stream);
  return true;
}

std::pair<at::Tensor, at::Tensor> quantize_rows_fp8_kernel(const at::Tensor& x) {
  if (!x.is_cuda() || x.dim() != 2 || !kernel_dtype(x.scalar_type())) throw Error("quantize_rows_fp8_kernel: a 2-D CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  return quantize(x.contiguous(), at::cuda::getCurrentCUDAStream(x.device().index()).stream());
}

std::string fp8_tuning_report() {
  std::lock_guard<std::mutex> lock(g_mutex);
  nlohmann::json j = nlohmann::json::array();
  for (const auto& [s, c] : g_choices)
    j.push_back({{"m", s.m}, {"n", s.n}, {"k", s.k}, {"bias", s.bias}, {"bf16_ms", c.bf16_ms}, {"fp8_ms", c.fp8_ms},
                 {"quant_ms", c.quant_ms}, {"fp8", c.fp8}});
  return j.dump();
}

}  // namespace diffract::models
