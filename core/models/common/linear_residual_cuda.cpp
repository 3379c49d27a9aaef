// The cuBLASLt side of linear_residual. Row-major out [M, N] = x [M, K] @ W^T + residual + bias
// is, read column-major, out^T [N, M] = W [N, K] (stored K x N, transposed) · x^T [K, M] +
// residual^T: one GEMM with beta = 1 on C and the bias in the epilogue, bias indexed by D's rows.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include "core/models/common/linear_residual.h"
#include "core/util/device_work.h"
#include "core/util/error.h"

namespace diffract::models {

namespace {

void check(cublasStatus_t status, const std::string& call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error("linear_residual: " + call + " failed: " + cublasLtGetStatusName(status) + " (" +
                cublasLtGetStatusString(status) + ")");
}

template <typename Handle, cublasStatus_t (*Destroy)(Handle)>
struct Owned {
  Owned() = default;
  Owned(Owned&& o) noexcept : h(o.h) { o.h = nullptr; }
  Owned& operator=(Owned&& o) noexcept {
    std::swap(h, o.h);
    return *this;
  }
  ~Owned() {
    if (h) Destroy(h);
  }
  Handle h = nullptr;
};
using MatmulDesc = Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using Layout = Owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using Preference = Owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

template <typename T>
void set(const MatmulDesc& d, cublasLtMatmulDescAttributes_t attribute, const T& value, const char* name) {
  check(cublasLtMatmulDescSetAttribute(d.h, attribute, &value, sizeof(value)),
        std::string("cublasLtMatmulDescSetAttribute(") + name + ")");
}

template <typename T>
void set(const Preference& p, cublasLtMatmulPreferenceAttributes_t attribute, const T& value, const char* name) {
  check(cublasLtMatmulPreferenceSetAttribute(p.h, attribute, &value, sizeof(value)),
        std::string("cublasLtMatmulPreferenceSetAttribute(") + name + ")");
}

Layout layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  Layout l;
  check(cublasLtMatrixLayoutCreate(&l.h, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld),
        "cublasLtMatrixLayoutCreate");
  return l;
}

// The largest power of two up to 256 dividing the address: the heuristic only offers kernels
// whose vector loads this pointer allows.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

// ATen's setting for its own reduced-precision GEMMs (torch.backends.cuda.matmul.allow_*_reduced_precision_reduction).
uint32_t reduction_mask(at::ScalarType dtype) {
  const auto& ctx = at::globalContext();
  const auto option = dtype == at::kHalf ? ctx.allowFP16ReductionCuBLAS() : ctx.allowBF16ReductionCuBLAS();
  switch (option) {
    case at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK: return CUBLASLT_REDUCTION_SCHEME_MASK;
    case at::CuBLASReductionOption::DisallowReducedPrecisionAllowSplitK:
      return CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_NONE;
    default: return CUBLASLT_REDUCTION_SCHEME_NONE;
  }
}

// One GEMM problem, residual optional (beta 0 then, C = D): its descriptors, from which the
// heuristic offers candidates; the output is allocated only when the GEMM runs (run()).
struct Problem {
  cudaDataType_t type{};
  int64_t m = 0, n = 0, k = 0;
  std::vector<int64_t> out_sizes;
  at::Tensor bias;
  MatmulDesc desc;
  Layout a, b, cd;
  Preference pref;
};

bool set_up(Problem& p, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
            const at::Tensor& residual) {
  const auto dtype = x.scalar_type();
  if (dtype == at::kBFloat16) p.type = CUDA_R_16BF;
  else if (dtype == at::kHalf) p.type = CUDA_R_16F;
  else return false;
  const bool with_c = residual.defined();
  if (x.dim() < 1 || weight.dim() != 2 || weight.scalar_type() != dtype) return false;
  if (with_c && residual.scalar_type() != dtype) return false;
  p.k = x.size(-1), p.n = weight.size(0);
  if (weight.size(1) != p.k || p.k == 0 || p.n == 0) return false;
  p.out_sizes = x.sizes().vec();
  p.out_sizes.back() = p.n;
  if (with_c && residual.sizes() != at::IntArrayRef(p.out_sizes)) return false;
  p.m = x.numel() / p.k;
  if (p.m == 0) return false;
  const auto device = x.device();
  if (!x.is_cuda() || !weight.is_cuda() || weight.device() != device || (with_c && residual.device() != device)) return false;
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != p.n || bias.device() != device)) return false;
  if (!x.is_contiguous() || !weight.is_contiguous() || (with_c && !residual.is_contiguous())) return false;

  // The epilogue reads the bias in D's type (a parameter already is: no copy).
  p.bias = bias.defined() ? bias.to(dtype).contiguous() : at::Tensor();
  check(cublasLtMatmulDescCreate(&p.desc.h, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  set(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(CUBLAS_OP_T), "TRANSA");
  set(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(CUBLAS_OP_N), "TRANSB");
  set(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
      static_cast<uint32_t>(p.bias.defined() ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT), "EPILOGUE");
  if (p.bias.defined()) {
    // Set before the heuristic: it picks kernels for this pointer's alignment.
    set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(p.bias.data_ptr()), "BIAS_POINTER");
    set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(p.type), "BIAS_DATA_TYPE");
  }
  p.a = layout(p.type, p.k, p.n, p.k);   // W^T, column-major
  p.b = layout(p.type, p.k, p.m, p.k);   // x^T
  p.cd = layout(p.type, p.n, p.m, p.n);  // residual^T and out^T

  check(cublasLtMatmulPreferenceCreate(&p.pref.h), "cublasLtMatmulPreferenceCreate");
  set(p.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(at::cuda::getCUDABlasLtWorkspaceSize()),
      "MAX_WORKSPACE_BYTES");
  set(p.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reduction_mask(dtype), "REDUCTION_SCHEME_MASK");
  set(p.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(weight.data_ptr()), "MIN_ALIGNMENT_A_BYTES");
  set(p.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(x.data_ptr()), "MIN_ALIGNMENT_B_BYTES");
  // D is a new tensor from the caching allocator, whose blocks are 512-byte aligned.
  set(p.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, with_c ? alignment(residual.data_ptr()) : 256u,
      "MIN_ALIGNMENT_C_BYTES");
  set(p.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, 256u, "MIN_ALIGNMENT_D_BYTES");
  return true;
}

std::vector<cublasLtMatmulHeuristicResult_t> candidates(const Problem& p, int max) {
  std::vector<cublasLtMatmulHeuristicResult_t> found(static_cast<size_t>(std::max(max, 1)));
  int count = 0;
  const auto status = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), p.desc.h, p.a.h, p.b.h,
                                                     p.cd.h, p.cd.h, p.pref.h, static_cast<int>(found.size()),
                                                     found.data(), &count);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) count = 0;
  else check(status, "cublasLtMatmulAlgoGetHeuristic");
  found.resize(static_cast<size_t>(count));
  return found;
}

at::Tensor run(const Problem& p, const cublasLtMatmulHeuristicResult_t& algo, const at::Tensor& x,
               const at::Tensor& weight, const at::Tensor& residual) {
  // From the caching allocator, on this stream: stream-ordered reuse, and capturable.
  auto out = at::empty(p.out_sizes, x.options());
  at::Tensor workspace;
  if (algo.workspaceSize > 0)
    workspace = at::empty({static_cast<int64_t>(algo.workspaceSize)}, x.options().dtype(at::kByte));
  const float alpha = 1.0f, beta = residual.defined() ? 1.0f : 0.0f;
  const void* c = residual.defined() ? residual.data_ptr() : out.data_ptr();
  check(cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), p.desc.h, &alpha, weight.data_ptr(), p.a.h,
                       x.data_ptr(), p.b.h, &beta, c, p.cd.h, out.data_ptr(), p.cd.h, &algo.algo,
                       workspace.defined() ? workspace.data_ptr() : nullptr, algo.workspaceSize,
                       at::cuda::getCurrentCUDAStream(x.device().index()).stream()),
        "cublasLtMatmul");
  return out;
}

// Per GEMM case (shape, dtype, bias, device, operand alignments): ATen's GEMM + add, or the
// cuBLASLt algorithm that was fastest when the case was first seen. The heuristic's first pick
// reading C was slower than ATen's GEMM and add for some of SDXL's shapes (docs/benchmarks.md).
struct Choice {
  bool aten = true;
  cublasLtMatmulHeuristicResult_t algo{};
};

std::string case_key(const Problem& p, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& residual) {
  std::ostringstream key;
  key << x.device().index() << ' ' << p.type << ' ' << p.m << ' ' << p.n << ' ' << p.k << ' ' << p.bias.defined() << ' '
      << alignment(weight.data_ptr()) << ' ' << alignment(x.data_ptr()) << ' ' << alignment(residual.data_ptr());
  return key.str();
}

Choice tune(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& residual,
            const Problem& first) {
  Choice best;
  double best_ms = graph_ms_per_call(x.device(), [&] { (void)(residual + at::linear(x, weight, bias)); }, 20);
  for (const auto& candidate : candidates(first, 8)) {
    double ms = 0;
    try {
      ms = graph_ms_per_call(x.device(), [&] {
        Problem p;
        set_up(p, x, weight, bias, residual);
        (void)run(p, candidate, x, weight, residual);
      }, 20);
    } catch (const std::exception&) {
      continue;  // a candidate cuBLASLt offers but cannot run here: the others remain
    }
    if (ms < best_ms) best_ms = ms, best.aten = false, best.algo = candidate;
  }
  return best;
}

}  // namespace

bool fused_linear_residual_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                const at::Tensor& residual, at::Tensor& out) {
  static std::mutex mutex;
  static std::map<std::string, Choice> choices;
  const c10::cuda::CUDAGuard guard(x.device());
  Problem p;
  if (!set_up(p, x, weight, bias, residual)) return false;
  const auto key = case_key(p, x, weight, residual);
  Choice choice;
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = choices.find(key);
    if (it != choices.end()) {
      choice = it->second;
    } else {
      // Timing needs the device to itself: under a capture an unseen case takes ATen's ops.
      if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return false;
      choice = choices[key] = tune(x, weight, bias, residual, p);
    }
  }
  if (choice.aten) return false;
  out = run(p, choice.algo, x, weight, residual);
  return true;
}

int lt_gemm_candidates(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       const at::Tensor& residual, int max) {
  const c10::cuda::CUDAGuard guard(x.device());
  Problem p;
  if (!set_up(p, x, weight, bias, residual)) return 0;
  return static_cast<int>(candidates(p, max).size());
}

bool lt_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& residual,
             int index, at::Tensor& out) {
  if (index < 0) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  Problem p;
  if (!set_up(p, x, weight, bias, residual)) return false;
  const auto found = candidates(p, index + 1);
  if (static_cast<int>(found.size()) <= index) return false;
  out = run(p, found[static_cast<size_t>(index)], x, weight, residual);
  return true;
}

}  // namespace diffract::models
