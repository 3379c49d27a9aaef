#include "core/models/common/fp8_linear.h"

#include <atomic>
#include <optional>
#include <vector>

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

struct Offer {
  at::Tensor x;  // held, so that its memory is not another tensor's while the offer stands
  std::uint32_t version = 0;
  Fp8Rows rows;
};
constexpr std::size_t kMaxOffers = 4;
thread_local std::vector<Offer> t_offers;

bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.scalar_type() == b.scalar_type() && a.device() == b.device();
}

std::atomic<std::int64_t> g_offered{0}, g_taken{0}, g_quantised{0};

// The offer standing for x; an offer for x's data whose version has moved on is dropped.
std::optional<Fp8Rows> find_offer(const at::Tensor& x) {
  for (auto it = t_offers.begin(); it != t_offers.end(); ++it) {
    if (!same_view(it->x, x)) continue;
    if (it->version == x._version()) return it->rows;
    t_offers.erase(it);
    break;
  }
  return std::nullopt;
}

}  // namespace

#ifdef DIFFRACT_HAS_CUDA_KERNELS
// fp8_cuda.cpp: false where the CUDA path does not take the case (then the layer runs in bf16).
// `rows`: x's e4m3 rows where a kernel made them, else null.
bool fp8_linear_cuda(const at::Tensor& x, const Fp8Rows* rows, Fp8WeightCache& cache, const at::Tensor& weight,
                     const at::Tensor& bias, at::Tensor& out);
bool fp8_rows_useful(const at::Tensor& x);
#else
at::Tensor activation_with_fp8_rows(const at::Tensor&, Fp8RowsActivation) { return {}; }
bool join_gelu_with_fp8_rows(at::Tensor&, const at::Tensor&, const at::Tensor&) { return false; }
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

bool Fp8WeightCache::made_from(const at::Tensor& weight, std::uint64_t generation) const {
  return fp8_ && source_ == weight.data_ptr() && generation_ == generation && fp8_->weight.device() == weight.device();
}

bool Fp8WeightCache::ready_for(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(mutex_);
  return made_from(weight, g_generation.load());
}

std::shared_ptr<const Fp8Weight> Fp8WeightCache::get(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto generation = g_generation.load();
  if (!made_from(weight, generation)) {
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
  const auto rows = t_offers.empty() ? std::nullopt : find_offer(x);
  const std::int64_t m = x.numel() / k;
  if (rows && (rows->q.dim() != 2 || rows->q.size(0) != m || rows->q.size(1) != k || rows->scale.numel() != m))
    throw Error("fp8_linear: offered rows of shape " + c10::str(rows->q.sizes()) + " for an input " +
                c10::str(x.sizes()));
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor out;
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  if (x.is_cuda() && !fp8_linear_cuda(x, rows ? &*rows : nullptr, *cache, weight, bias, out)) return {};
#endif
  if (x.is_cuda() && !out.defined()) return {};
  if (!x.is_cuda()) {
    const auto w = cache->get(weight);
    const auto [q, scale] = rows ? std::pair(rows->q, rows->scale) : quantize_rows_fp8(x.reshape({-1, k}));
    out = scaled_linear_fp8_reference(q, scale, *w, bias, x.scalar_type());
  }
  ++(rows ? g_taken : g_quantised);
  return out.view(sizes);
}

bool fp8_rows_wanted(const at::Tensor& x) {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  static const bool on = options::flag(options::Id::Fp8FusedRows);  // process scope: read once
  return on && x.defined() && x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() >= 2 &&
         x.size(-1) % 16 == 0 && fp8_wanted() && fp8_rows_useful(x);
#else
  (void)x;
  return false;
#endif
}

void offer_fp8_rows(const at::Tensor& x, Fp8Rows rows) {
  for (auto it = t_offers.begin(); it != t_offers.end(); ++it)
    if (same_view(it->x, x)) {
      t_offers.erase(it);
      break;
    }
  if (t_offers.size() >= kMaxOffers) t_offers.erase(t_offers.begin());
  t_offers.push_back({x, static_cast<std::uint32_t>(x._version()), std::move(rows)});
  ++g_offered;
}

std::optional<Fp8Rows> offered_fp8_rows(const at::Tensor& x) { return find_offer(x); }

void drop_fp8_rows() { t_offers.clear(); }

Fp8RowsCounts fp8_rows_counts() { return {g_offered.load(), g_taken.load(), g_quantised.load()}; }

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
