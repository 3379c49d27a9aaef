// Linear layers' GEMMs through cuBLASLt with an algorithm chosen by timing (see layers.h,
// models::linear). cuBLAS's own heuristic picks one algorithm per shape from a model of the GPU;
// for SDXL's batch-1 shapes on an H200 ([1024, 1280] x [1280, 1280]: 80 output tiles of 128 x
// 128 on 132 SMs) that choice leaves SMs idle. Here the first call of each shape (in the eager
// warm-up, before any CUDA graph captures it) times up to kCandidates of the algorithms cuBLASLt
// proposes, and ATen's at::linear, and keeps the fastest; later calls, graph captures included,
// run the kept choice. A GEMM whose output goes through GELU (tanh) can take the GELU into
// cuBLASLt's epilogue (models::linear_gelu_tanh): then the timing weighs those algorithms against
// at::linear followed by at::gelu.
#include <cublasLt.h>
#include <cublas_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <nlohmann/json.hpp>

#include "core/models/common/layers.h"
#include "core/models/common/gpu_timing.h"
#include "core/models/common/gpu_tuning.h"
#include "core/util/error.h"
#include "core/util/graphed_function.h"
#include "core/util/options.h"

namespace diffract::models {

namespace {

constexpr int kCandidates = 16;
constexpr std::size_t kWorkspaceBytes = std::size_t(32) << 20;

struct Shape {
  int device;
  std::int64_t m, n, k;
  at::ScalarType dtype;
  bool bias;
  int align;  // bytes every operand's address is a multiple of (16, 8, 4, 2)
  bool gelu;  // GELU (tanh) in the epilogue
  // A strided batch: `batch` GEMMs of m rows, x's and out's batch items x_stride and out_stride
  // elements apart (their rows k and n apart); 1, 0, 0 for one GEMM.
  std::int64_t batch = 1, x_stride = 0, out_stride = 0;
  bool operator<(const Shape& o) const {
    return std::tie(device, m, n, k, dtype, bias, align, gelu, batch, x_stride, out_stride) <
           std::tie(o.device, o.m, o.n, o.k, o.dtype, o.bias, o.align, o.gelu, o.batch, o.x_stride, o.out_stride);
  }
};

struct Choice {
  bool lt = false;  // false: at::linear (with at::gelu for a GELU shape) was fastest (or nothing else ran)
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace = 0;
  // What the timing saw, for the report: ms per call of ATen's GEMM, cuBLASLt's first proposal
  // and the one kept; how many proposals ran.
  double aten_ms = 0, first_ms = 0, best_ms = 0;
  int tried = 0;
};

std::mutex g_mutex;
std::map<Shape, Choice> g_choices;
std::map<std::pair<int, cudaStream_t>, at::Tensor> g_workspaces;  // per stream: calls on two streams overlap

void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("cuBLASLt ") + what + " failed: " + cublasGetStatusString(s));
}

cudaDataType_t cuda_type(at::ScalarType t) { return t == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F; }

int alignment(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  for (int b : {16, 8, 4}) if (a % b == 0) return b;
  return 2;
}

// The matmul and layouts for out [m, n] = x [m, k] w[n, k]^T (+ bias[n]), row-major, as cuBLASLt's
// column-major D [n, m] = op(A) B with A = w seen as [k, n] (transposed), B = x seen as [k, m].
struct Problem {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  explicit Problem(const Shape& s) {
    check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "descriptor");
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)), "transa");
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)), "transb");
    // cuBLASLt's GELU epilogue is the tanh approximation.
    if (s.bias || s.gelu) {
      const cublasLtEpilogue_t e = s.gelu ? (s.bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU)
                                          : CUBLASLT_EPILOGUE_BIAS;
      check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)), "epilogue");
    }
    const auto type = cuda_type(s.dtype);
    check(cublasLtMatrixLayoutCreate(&a, type, s.k, s.n, s.k), "layout A");
    check(cublasLtMatrixLayoutCreate(&b, type, s.k, s.m, s.k), "layout B");
    check(cublasLtMatrixLayoutCreate(&c, type, s.n, s.m, s.n), "layout C");
    if (s.batch > 1) {
      // The weight is shared (offset 0); each batch item's bias is the same (the default).
      const std::int32_t count = static_cast<std::int32_t>(s.batch);
      const std::int64_t offsets[] = {0, s.x_stride, s.out_stride};
      const cublasLtMatrixLayout_t layouts[] = {a, b, c};
      for (int i = 0; i < 3; ++i) {
        check(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
              "batch count");
        check(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offsets[i],
                                               sizeof(offsets[i])),
              "batch offset");
      }
    }
  }
  ~Problem() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  cublasStatus_t run(const cublasLtMatmulAlgo_t& algo, std::size_t workspace_bytes, const at::Tensor& x,
                     const at::Tensor& w, const at::Tensor& bias, at::Tensor& out, void* workspace, cudaStream_t stream) {
    if (bias.defined()) {
      const void* p = bias.data_ptr();
      check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p, sizeof(p)), "bias pointer");
    }
    const float one = 1.f, zero = 0.f;
    return cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), op, &one, w.data_ptr(), a, x.data_ptr(), b, &zero,
                          out.data_ptr(), c, out.data_ptr(), c, &algo, workspace, workspace_bytes, stream);
  }
};

void* workspace_for(int device, cudaStream_t stream) {
  auto& w = g_workspaces[{device, stream}];
  if (!w.defined()) {
    if (capturing(stream)) note_unprepared_in_capture();  // kept for good, yet from the graph's pool
    w = at::empty({static_cast<std::int64_t>(kWorkspaceBytes)},
                  at::TensorOptions().dtype(at::kByte).device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  }
  return w.data_ptr();
}

// `aten`: what runs where cuBLASLt is not kept, timed against its proposals.
Choice tune(const Shape& s, Problem& p, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
            at::Tensor& out, cudaStream_t stream, const std::function<void()>& aten) {
  Choice best;
  best.aten_ms = time_ms(stream, aten);
  best.best_ms = best.aten_ms;
  cublasLtMatmulPreference_t pref;
  check(cublasLtMatmulPreferenceCreate(&pref), "preference");
  const std::uint64_t max_ws = kWorkspaceBytes;
  const std::uint32_t align = static_cast<std::uint32_t>(s.align);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align));
  cublasLtMatmulHeuristicResult_t found[kCandidates];
  int count = 0;
  const auto status = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), p.op, p.a, p.b, p.c, p.c,
                                                     pref, kCandidates, found, &count);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status != CUBLAS_STATUS_SUCCESS) return best;
  void* ws = workspace_for(s.device, stream);
  for (int i = 0; i < count; ++i) {
    if (found[i].state != CUBLAS_STATUS_SUCCESS || found[i].workspaceSize > kWorkspaceBytes) continue;
    if (p.run(found[i].algo, found[i].workspaceSize, x, w, bias, out, ws, stream) != CUBLAS_STATUS_SUCCESS) continue;
    const double ms = time_ms(stream, [&] { p.run(found[i].algo, found[i].workspaceSize, x, w, bias, out, ws, stream); });
    ++best.tried;
    if (best.tried == 1) best.first_ms = ms;
    if (ms < best.best_ms) {
      best.best_ms = ms;
      best.lt = true;
      best.algo = found[i].algo;
      best.workspace = found[i].workspaceSize;
    }
  }
  return best;
}

std::string store_key(const Shape& s) {
  return std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k) + " " + c10::toString(s.dtype) +
         (s.bias ? " bias" : "") + " align" + std::to_string(s.align) + (s.gelu ? " gelu" : "") +
         (s.batch > 1 ? " batch" + std::to_string(s.batch) + " x" + std::to_string(s.x_stride) + " out" +
                            std::to_string(s.out_stride)
                      : "");
}

nlohmann::json to_record(const Choice& c) {
  nlohmann::json algo = nlohmann::json::array();
  for (auto word : c.algo.data) {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(word));
    algo.push_back(hex);
  }
  return {{"cublaslt", c.lt}, {"algo", algo}, {"workspace", c.workspace}, {"aten_ms", c.aten_ms},
          {"first_ms", c.first_ms}, {"best_ms", c.best_ms}, {"tried", c.tried}};
}

// A stored choice, if it is whole and cuBLASLt still accepts its algorithm for this problem.
std::optional<Choice> from_record(const nlohmann::json& r, Problem& p) {
  try {
    Choice c;
    c.lt = r.at("cublaslt").get<bool>();
    c.aten_ms = r.at("aten_ms").get<double>();
    c.first_ms = r.at("first_ms").get<double>();
    c.best_ms = r.at("best_ms").get<double>();
    c.tried = r.at("tried").get<int>();
    if (!c.lt) return c;
    const auto& algo = r.at("algo");
    if (!algo.is_array() || algo.size() != std::size(c.algo.data)) return std::nullopt;
    for (std::size_t i = 0; i < algo.size(); ++i) {
      const auto hex = algo[i].get<std::string>();
      if (hex.size() != 16 || hex.find_first_not_of("0123456789abcdef") != std::string::npos) return std::nullopt;
      c.algo.data[i] = std::stoull(hex, nullptr, 16);
    }
    c.workspace = r.at("workspace").get<std::size_t>();
    if (c.workspace > kWorkspaceBytes) return std::nullopt;
    cublasLtMatmulHeuristicResult_t checked{};
    if (cublasLtMatmulAlgoCheck(at::cuda::getCurrentCUDABlasLtHandle(), p.op, p.a, p.b, p.c, p.c, &c.algo, &checked) !=
            CUBLAS_STATUS_SUCCESS ||
        checked.state != CUBLAS_STATUS_SUCCESS || checked.workspaceSize > c.workspace)
      return std::nullopt;
    return c;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

bool tuning_from_env() {
  return options::flag(options::Id::GemmTuning);
}
bool g_tuning = tuning_from_env();

}  // namespace

bool gemm_tuning_enabled() { return g_tuning; }
void set_gemm_tuning(bool on) { g_tuning = on; }

namespace {

// The kept choice for shape s (timed on its first call, or read from the tuning store), run into
// `out` (made [rows, n] here where undefined); false where ATen's path was kept (or where a
// capture meets a shape not yet timed).
bool run_tuned(const Shape& s, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& out,
               const std::function<void()>& aten) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream(x.device().index()).stream();
  // The descriptors per shape, made once per thread (run() sets the bias pointer on them, so
  // threads must not share them); eager models call linear() hundreds of times a step.
  thread_local std::map<Shape, std::unique_ptr<Problem>> problems;
  auto& slot = problems[s];
  if (!slot) slot = std::make_unique<Problem>(s);
  Problem& p = *slot;
  Choice choice;
  void* ws = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_choices.find(s);
    if (it == g_choices.end()) {
      auto& store = tuning_store_for(s.device);
      const auto key = store_key(s);
      const auto t0 = now_ns();
      std::optional<Choice> stored;
      if (const auto record = store.find("gemm", key)) stored = from_record(*record, p);
      if (stored) {
        it = g_choices.emplace(s, *stored).first;
        count_tuning("gemm", true, ms_between(t0, now_ns()));
      } else if (capturing(stream)) {
        note_unprepared_in_capture();
        return false;  // no timing inside a capture: ATen's GEMM
      } else {
        if (!out.defined()) out = at::empty({s.m, s.n}, x.options());
        it = g_choices.emplace(s, tune(s, p, x, w, bias, out, stream, aten)).first;
        store.put("gemm", key, to_record(it->second));
        count_tuning("gemm", false, ms_between(t0, now_ns()));
      }
    }
    choice = it->second;
    if (choice.lt) ws = workspace_for(s.device, stream);
  }
  if (!choice.lt) return false;
  if (!out.defined()) out = at::empty({s.m, s.n}, x.options());
  check(p.run(choice.algo, choice.workspace, x, w, bias, out, ws, stream), "matmul");
  return true;
}

bool operands_ok(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const auto dtype = x.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  if (w.scalar_type() != dtype || (bias.defined() && (bias.scalar_type() != dtype || !bias.is_contiguous()))) return false;
  return w.dim() == 2 && w.stride(1) == 1 && w.stride(0) == w.size(1) && w.size(0) >= 1 && w.size(1) >= 1 &&
         x.size(-1) == w.size(1) && (!bias.defined() || bias.numel() == w.size(0));
}

int operand_alignment(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  return std::min({alignment(x.data_ptr()), alignment(w.data_ptr()), bias.defined() ? alignment(bias.data_ptr()) : 16});
}

}  // namespace

bool tuned_linear_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& out, bool gelu) {
  // x [M, K] contiguous, w [N, K] rows contiguous, bias [N] or undefined; bf16 / fp16 alike.
  // With `gelu`, out = gelu_tanh(x w^T + bias), or false where the timing kept ATen's two ops.
  if (x.dim() != 2 || !x.is_contiguous() || x.size(0) < 1 || !operands_ok(x, w, bias)) return false;
  // `out` only where cuBLASLt runs (where at::linear was kept it makes its own); a fresh tensor
  // from the caching allocator is 16-byte aligned or better.
  const Shape s{x.device().index(), x.size(0), w.size(0), x.size(1), x.scalar_type(), bias.defined(),
                operand_alignment(x, w, bias), gelu};
  return run_tuned(s, x, w, bias, out, [&] {
    if (gelu) at::gelu(at::linear(x, w, bias), "tanh");
    else at::linear(x, w, bias);
  });
}

bool tuned_linear_batched_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& out) {
  // x [B, M, K] and out [B, M, N], each batch item's rows contiguous and adjacent, the items at
  // any stride that does not overlap them.
  if (x.dim() != 3 || out.dim() != 3 || !operands_ok(x, w, bias) || out.scalar_type() != x.scalar_type() ||
      out.device() != x.device())
    return false;
  const std::int64_t b = x.size(0), m = x.size(1), k = x.size(2), n = w.size(0);
  if (b < 2 || m < 1 || out.size(0) != b || out.size(1) != m || out.size(2) != n) return false;
  if (x.stride(2) != 1 || x.stride(1) != k || x.stride(0) < m * k || out.stride(2) != 1 || out.stride(1) != n ||
      out.stride(0) < m * n)
    return false;
  const Shape s{x.device().index(), m, n, k, x.scalar_type(), bias.defined(),
                std::min(operand_alignment(x, w, bias), alignment(out.data_ptr())), false, b, x.stride(0),
                out.stride(0)};
  return run_tuned(s, x, w, bias, out, [&] { out.copy_(at::linear(x, w, bias)); });
}

std::string gemm_tuning_report() {
  std::lock_guard<std::mutex> lock(g_mutex);
  nlohmann::json j = nlohmann::json::array();
  for (const auto& [s, c] : g_choices)
    j.push_back({{"m", s.m}, {"n", s.n}, {"k", s.k}, {"bias", s.bias}, {"dtype", c10::toString(s.dtype)},
                 {"gelu", s.gelu}, {"batch", s.batch}, {"aten_ms", c.aten_ms}, {"first_ms", c.first_ms}, {"best_ms", c.best_ms},
                 {"cublaslt", c.lt},
                 {"tried", c.tried}});
  return j.dump();
}

}  // namespace diffract::models
