#include "core/models/common/fp8_linear.h"

#include <atomic>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "core/models/common/layers.h"
#include "core/util/error.h"
#include "core/util/options.h"

namespace diffract::models {

namespace {

constexpr double kE4M3Max = 448.0;
constexpr double kMinScale = 1e-12;

std::atomic<std::uint64_t> g_generation{1};

// Per row of a 2-D float32 tensor: its scale and the row times 1 / scale in e4m3. Written as the
// kernel computes it (amax times the float 1 / 448, not divided by 448: ATen's CUDA division by a
// scalar multiplies by its reciprocal, so only this form is the same on every device).
std::pair<at::Tensor, at::Tensor> quantize_rows_float(const at::Tensor& f) {
  const auto scale = (f.abs().amax(1, /*keepdim=*/true) * static_cast<float>(1.0 / kE4M3Max)).clamp_min(kMinScale);
  const auto q = (f * scale.reciprocal()).clamp(-kE4M3Max, kE4M3Max).to(at::kFloat8_e4m3fn);
  return {q, scale};
}

}  // namespace

#ifdef DIFFRACT_HAS_CUDA_KERNELS
// fp8_cuda.cpp: false where the CUDA path does not take the case (then the layer runs in bf16).
bool fp8_linear_cuda(const at::Tensor& x, Fp8WeightCache& cache, const at::Tensor& weight, const at::Tensor& bias,
                     at::Tensor& out);
#else
std::string fp8_tuning_report() { return "[]"; }
std::pair<at::Tensor, at::Tensor> quantize_rows_fp8_kernel(const at::Tensor&) {
  throw Error("this build of Diffract has no CUDA kernels (fp8 quantisation)");
}
#endif

Fp8Weight quantize_weight_fp8(const at::Tensor& w) {
  at::NoGradGuard no_grad;
  auto [q, scale] = quantize_rows_float(w.detach().to(at::kFloat));
  return {q.contiguous(), scale.view({1, -1}).contiguous()};
}

std::pair<at::Tensor, at::Tensor> quantize_rows_fp8(const at::Tensor& x) {
  at::NoGradGuard no_grad;
  return quantize_rows_float(x.to(at::kFloat));
}

at::Tensor scaled_linear_fp8_reference(const at::Tensor& q, const at::Tensor& x_scale, const Fp8Weight& w,
                                       const at::Tensor& bias, at::ScalarType out) {
  const auto x = q.to(at::kFloat) * x_scale;
  const auto weight = w.weight.to(at::kFloat) * w.scale.t();
  return at::linear(x, weight, bias.defined() ? bias.to(at::kFloat) : at::Tensor()).to(out);
}

std::shared_ptr<const Fp8Weight> Fp8WeightCache::get(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto generation = g_generation.load();
  if (!fp8_ || source_ != weight.data_ptr() || generation_ != generation || fp8_->weight.device() != weight.device()) {
    fp8_ = std::make_shared<const Fp8Weight>(quantize_weight_fp8(weight));
    source_ = weight.data_ptr();
    generation_ = generation;
  }
  return fp8_;
}

at::Tensor fp8_linear(const at::Tensor& x, Fp8WeightCache* cache, const at::Tensor& weight, const at::Tensor& bias) {
  if (!cache || !fp8_wanted() || x.dim() < 2) return {};
  const std::int64_t k = weight.size(1), n = weight.size(0);
  if (k % 16 != 0 || n % 16 != 0 || x.size(-1) != k) return {};
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad())) return {};
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  const auto x2 = x.reshape({-1, k});
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  if (x.is_cuda()) {
    at::Tensor out;
    if (!fp8_linear_cuda(x2.contiguous(), *cache, weight, bias, out)) return {};
    return out.view(sizes);
  }
#endif
  if (x.is_cuda()) return {};
  const auto w = cache->get(weight);
  const auto [q, scale] = quantize_rows_fp8(x2);
  return scaled_linear_fp8_reference(q, scale, *w, bias, x.scalar_type()).view(sizes);
}

bool fp8_wanted() { return options::value(options::Id::Precision) == "fp8"; }

int allow_fp8(torch::nn::Module& root) {
  int marked = 0;
  const auto mark = [&](torch::nn::Module& m) {
    if (auto* l = dynamic_cast<LinearImpl*>(&m)) {
      if (!l->fp8) l->fp8 = std::make_shared<Fp8WeightCache>();
      ++marked;
    }
  };
  mark(root);
  for (const auto& child : root.modules(/*include_self=*/false)) mark(*child);
  return marked;
}

void invalidate_fp8_weights() { ++g_generation; }

}  // namespace diffract::models
