// The CUDA side of fp8_linear.h: the activations quantised per token by our kernel, the GEMM by
// at::_scaled_mm with row-wise scales (the e4m3 weight's per channel, the activations' per
// token) and the bias applied in its epilogue, fast fp8 accumulation, bf16 out. Each shape is
// timed on its first call against the layer's bf16 GEMM (models::linear) and keeps fp8 only where
// it is clearly faster (kFp8MinSaving); the times go to the GPU's tuning store (gpu_tuning.h),
// where a later process finds them.
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
#include "core/util/graphed_function.h"
#include "core/util/options.h"
#include "core/models/common/kernel_dtype.h"
#include "core/models/common/layers.h"
#include "core/models/common/strided_rows.h"
#include "core/util/error.h"

namespace diffract::models {

bool fp8_linear_cuda(const at::Tensor& x, const Fp8Rows* rows, Fp8WeightCache& cache, const at::Tensor& weight,
                     const at::Tensor& bias, at::Tensor& out);
bool fp8_rows_useful(const at::Tensor& x);

namespace {

struct Shape {
  int device;
  std::int64_t m, n, k;
  bool bias;
  bool rows;  // the input comes quantised (offered rows): the fp8 side costs its GEMM alone
  bool operator<(const Shape& o) const {
    return std::tie(device, m, n, k, bias, rows) < std::tie(o.device, o.m, o.n, o.k, o.bias, o.rows);
  }
};

struct Choice {
  bool fp8 = false;
  double bf16_ms = 0, fp8_ms = 0, quant_ms = 0;  // per call, as timed (quant_ms 0 with offered rows)
};

std::mutex g_mutex;
std::map<Shape, Choice> g_choices;

// fp8 rounds a layer's input and weight, so a layer keeps it only where it saves at least this
// share of the bf16 GEMM's time: a choice within the timings' noise would pay the rounding for
// nothing (SD3's output projection, 8192 x 64 x 1536, timed 0.5 % faster in fp8; the fp8 image
// moved from 43.7 to 38.3 dB PSNR when it and three text-stream GEMMs turned fp8 together).
constexpr double kFp8MinSaving = 0.05;

bool keeps_fp8(const Choice& c) { return c.fp8_ms < (1 - kFp8MinSaving) * c.bf16_ms; }

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

// x's rows as the kernel reads them (strided_rows.h: batch items of evenly strided rows); false
// for any other layout, and for rows that overlap.
bool row_layout(const at::Tensor& x, kernels::QuantizeRowsArgs& a) {
  const auto b = strided_row_batches(x);
  if (!b || b->row_stride < b->cols) return false;
  a.x = x.const_data_ptr();
  a.rows = b->rows_per_batch * b->batches;
  a.cols = b->cols;
  a.row_stride = b->row_stride;
  a.rows_per_batch = b->rows_per_batch;
  a.batch_stride = b->batch_stride;
  return true;
}

// x [..., K] -> its e4m3 rows [M, K] and scales [M, 1], read where x lies (a contiguous copy first
// where the kernel cannot read its layout).
std::pair<at::Tensor, at::Tensor> quantize(const at::Tensor& x, cudaStream_t stream) {
  kernels::QuantizeRowsArgs a;
  at::Tensor in = x;
  if (!row_layout(in, a)) {
    in = x.contiguous();
    row_layout(in, a);
  }
  auto q = at::empty({a.rows, a.cols}, x.options().dtype(at::kFloat8_e4m3fn));
  auto scale = at::empty({a.rows, 1}, x.options().dtype(at::kFloat));
  a.q = q.data_ptr();
  a.scale = scale.data_ptr<float>();
  a.dtype = *kernel_dtype(x.scalar_type());
  check(kernels::quantize_rows_fp8(a, stream), "quantize_rows");
  return {q, scale};
}

at::Tensor gemm(const at::Tensor& q, const at::Tensor& scale, const Fp8Weight& w, const at::Tensor& bias,
                at::ScalarType out) {
  return at::_scaled_mm(q, w.weight.t(), scale, w.scale, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                        std::nullopt, out, /*use_fast_accum=*/true);
}

at::Tensor run(const at::Tensor& x, const Fp8Rows* rows, const Fp8Weight& w, const at::Tensor& bias,
               cudaStream_t stream) {
  if (rows) return gemm(rows->q, rows->scale, w, bias, x.scalar_type());
  const auto [q, scale] = quantize(x, stream);
  return gemm(q, scale, w, bias, x.scalar_type());
}

}  // namespace

bool fp8_rows_useful(const at::Tensor& x) {
  if (!fp8_capable(x.device().index())) return false;
  const int device = x.device().index();
  const std::int64_t k = x.size(-1), m = x.numel() / k;
  std::lock_guard<std::mutex> lock(g_mutex);
  bool timed = false;
  for (const auto& [s, c] : g_choices) {
    if (s.device != device || s.m != m || s.k != k || !s.rows) continue;
    if (c.fp8) return true;
    timed = true;
  }
  return !timed;
}

bool fp8_linear_cuda(const at::Tensor& x, const Fp8Rows* rows, Fp8WeightCache& cache, const at::Tensor& weight,
                     const at::Tensor& bias, at::Tensor& out) {
  // Row-wise scaled GEMMs write bf16 only.
  if (x.scalar_type() != at::kBFloat16 || weight.scalar_type() != at::kBFloat16 ||
      (bias.defined() && bias.scalar_type() != at::kBFloat16) || x.dim() < 2)
    return false;
  const int device = x.device().index();
  if (!fp8_capable(device)) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream(device).stream();
  // The e4m3 weight is made by an eager call, not inside a capture (where its kernels would only
  // be recorded); asked only where fp8 runs, so shapes that keep bf16 never want one.
  const auto weight_at_hand = [&] {
    if (cache.ready_for(weight) || !capturing(stream)) return true;
    note_unprepared_in_capture();
    return false;
  };
  // Without the fused rows, x is read as it lies only where DIFFRACT_FP8_FUSED_ROWS is on (the
  // behaviour measured before it: a contiguous copy, then the kernel).
  static const bool fused = options::flag(options::Id::Fp8FusedRows);  // process scope: read once
  const auto in = rows || fused ? x : x.reshape({-1, x.size(-1)}).contiguous();
  if (options::value(options::Id::Fp8Layers) == "all") {
    if (!weight_at_hand()) return false;
    out = run(in, rows, *cache.get(weight), bias, stream);
    return true;
  }
  const Shape s{device, x.numel() / x.size(-1), weight.size(0), weight.size(1), bias.defined(), rows != nullptr};
  Choice choice;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_choices.find(s);
    if (it == g_choices.end()) {
      auto& store = tuning_store_for(device);
      const auto key = std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k) +
                       (s.bias ? " bias" : "") + (s.rows ? " rows" : "");
      const auto t0 = now_ns();
      Choice c;
      bool stored = false;
      if (const auto r = store.find("fp8", key)) {
        try {
          c.bf16_ms = r->at("bf16_ms").get<double>();
          c.fp8_ms = r->at("fp8_ms").get<double>();
          c.quant_ms = r->at("quant_ms").get<double>();
          c.fp8 = keeps_fp8(c);  // from the times, so a store written under another rule reads as this one
          stored = true;
        } catch (const std::exception&) {
        }
      }
      if (!stored && capturing(stream)) {
        note_unprepared_in_capture();
        return false;  // no timing inside a capture: bf16
      }
      if (!stored) {
        const auto w = cache.get(weight);
        c.bf16_ms = time_ms(stream, [&] { linear(rows || fused ? x : in, weight, bias); });
        if (!rows) c.quant_ms = time_ms(stream, [&] { quantize(in, stream); });
        c.fp8_ms = time_ms(stream, [&] { run(in, rows, *w, bias, stream); });
        c.fp8 = keeps_fp8(c);
        store.put("fp8", key, {{"fp8", c.fp8}, {"bf16_ms", c.bf16_ms}, {"fp8_ms", c.fp8_ms}, {"quant_ms", c.quant_ms}});
      }
      count_tuning("fp8", stored, ms_between(t0, now_ns()));
      it = g_choices.emplace(s, c).first;
    }
    choice = it->second;
  }
  if (!choice.fp8 || !weight_at_hand()) return false;
  out = run(in, rows, *cache.get(weight), bias, stream);
  return true;
}

namespace {

// Runs the row kernel `a` (its inputs and activation set) writing y_out and its rows' e4m3 codes
// and scales, and offers them for y_out. False where the kernel does not take the layout
// (nothing launched).
bool write_and_offer_rows(kernels::QuantizeRowsArgs& a, at::Tensor& y_out, const char* what) {
  const c10::cuda::CUDAGuard guard(y_out.device());
  const std::int64_t width = a.prefix_cols + a.cols;
  Fp8Rows rows{at::empty({a.rows, width}, y_out.options().dtype(at::kFloat8_e4m3fn)),
               at::empty({a.rows, 1}, y_out.options().dtype(at::kFloat))};
  a.y = y_out.mutable_data_ptr();
  a.q = rows.q.mutable_data_ptr();
  a.scale = rows.scale.mutable_data_ptr<float>();
  a.dtype = kernels::DType::BFloat16;
  const int err = kernels::quantize_rows_fp8(a, at::cuda::getCurrentCUDAStream(y_out.device().index()).stream());
  if (err == cudaErrorInvalidValue) return false;
  check(err, what);
  offer_fp8_rows(y_out, std::move(rows));
  return true;
}

}  // namespace

at::Tensor activation_with_fp8_rows(const at::Tensor& y, Fp8RowsActivation act) {
  const bool halves = act == Fp8RowsActivation::GegluHalves;
  if (!y.defined() || !y.is_cuda() || y.scalar_type() != at::kBFloat16 || y.dim() < 2 || y.numel() == 0 ||
      (halves && y.size(-1) % 2 != 0))
    return {};
  const std::int64_t width = halves ? y.size(-1) / 2 : y.size(-1);
  if (!fp8_rows_wanted(halves ? y.narrow(-1, 0, width) : y)) return {};
  kernels::QuantizeRowsArgs a;
  if (!row_layout(y, a)) return {};
  auto sizes = y.sizes().vec();
  sizes.back() = width;
  auto out = at::empty(sizes, y.options());
  a.cols = width;
  a.act = halves ? kernels::RowActivation::GegluHalves : kernels::RowActivation::GeluTanh;
  if (!write_and_offer_rows(a, out, halves ? "GEGLU + quantize_rows" : "GELU + quantize_rows")) return {};
  return out;
}

bool join_gelu_with_fp8_rows(at::Tensor& joined, const at::Tensor& prefix, const at::Tensor& y) {
  if (!joined.defined() || !joined.is_cuda() || joined.scalar_type() != at::kBFloat16 || !joined.is_contiguous() ||
      joined.dim() < 2 || joined.numel() == 0 || !prefix.defined() || !y.defined() ||
      prefix.scalar_type() != at::kBFloat16 || y.scalar_type() != at::kBFloat16 || prefix.device() != joined.device() ||
      y.device() != joined.device() || prefix.size(-1) + y.size(-1) != joined.size(-1) ||
      prefix.sizes().slice(0, prefix.dim() - 1) != joined.sizes().slice(0, joined.dim() - 1) ||
      y.sizes().slice(0, y.dim() - 1) != joined.sizes().slice(0, joined.dim() - 1))
    return false;
  const auto p = strided_rows(prefix);
  kernels::QuantizeRowsArgs a;
  if (!p || !row_layout(y, a) || a.rows != p->rows || !fp8_rows_wanted(joined)) return false;
  a.prefix = prefix.const_data_ptr();
  a.prefix_cols = p->cols;
  a.prefix_stride = p->stride;
  a.act = kernels::RowActivation::GeluTanh;
  return write_and_offer_rows(a, joined, "join + GELU + quantize_rows");
}

std::pair<at::Tensor, at::Tensor> quantize_rows_fp8_kernel(const at::Tensor& x) {
  if (!x.is_cuda() || x.dim() < 1 || x.numel() == 0 || !kernel_dtype(x.scalar_type()))
    throw Error("quantize_rows_fp8_kernel: wants a non-empty CUDA tensor of float, half or bfloat16");
  const c10::cuda::CUDAGuard guard(x.device());
  return quantize(x, at::cuda::getCurrentCUDAStream(x.device().index()).stream());
}

std::string fp8_tuning_report() {
  std::lock_guard<std::mutex> lock(g_mutex);
  nlohmann::json j = nlohmann::json::array();
  for (const auto& [s, c] : g_choices)
    j.push_back({{"m", s.m}, {"n", s.n}, {"k", s.k}, {"bias", s.bias}, {"rows", s.rows}, {"bf16_ms", c.bf16_ms},
                 {"fp8_ms", c.fp8_ms}, {"quant_ms", c.quant_ms}, {"fp8", c.fp8}});
  return j.dump();
}

}  // namespace diffract::models
