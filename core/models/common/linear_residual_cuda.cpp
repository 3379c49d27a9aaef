// The cuBLASLt side of linear_residual. Row-major out [M, N] = x [M, K] @ W^T + residual + bias
// is, read column-major, out^T [N, M] = W [N, K] (stored K x N, transposed) · x^T [K, M] +
// residual^T: one GEMM with beta = 1 on C and the bias in the epilogue, bias indexed by D's rows.
#include <cstdint>
#include <string>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

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
  Owned& operator=(Owned&&) = delete;
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

}  // namespace

bool fused_linear_residual_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                const at::Tensor& residual, at::Tensor& out) {
  const auto dtype = x.scalar_type();
  cudaDataType_t type;
  if (dtype == at::kBFloat16) type = CUDA_R_16BF;
  else if (dtype == at::kHalf) type = CUDA_R_16F;
  else return false;
  if (x.dim() < 1 || weight.dim() != 2 || weight.scalar_type() != dtype || residual.scalar_type() != dtype) return false;
  const int64_t k = x.size(-1), n = weight.size(0);
  if (weight.size(1) != k || k == 0 || n == 0) return false;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  if (residual.sizes() != at::IntArrayRef(out_sizes)) return false;
  const int64_t m = x.numel() / k;
  if (m == 0) return false;
  const auto device = x.device();
  if (!weight.is_cuda() || weight.device() != device || residual.device() != device) return false;
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != n || bias.device() != device)) return false;
  if (!x.is_contiguous() || !weight.is_contiguous() || !residual.is_contiguous()) return false;

  const c10::cuda::CUDAGuard guard(device);
  // The epilogue reads the bias in D's type (a parameter already is: no copy).
  const auto b = bias.defined() ? bias.to(dtype).contiguous() : at::Tensor();
  auto d = at::empty(out_sizes, x.options());

  MatmulDesc desc;
  check(cublasLtMatmulDescCreate(&desc.h, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  set(desc, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(CUBLAS_OP_T), "TRANSA");
  set(desc, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(CUBLAS_OP_N), "TRANSB");
  set(desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
      static_cast<uint32_t>(b.defined() ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT), "EPILOGUE");
  if (b.defined()) {
    // Set before the heuristic: it picks kernels for this pointer's alignment.
    set(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(b.data_ptr()), "BIAS_POINTER");
    set(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(type), "BIAS_DATA_TYPE");
  }
  const auto a_layout = layout(type, k, n, k);   // W^T, column-major
  const auto b_layout = layout(type, k, m, k);   // x^T
  const auto cd_layout = layout(type, n, m, n);  // residual^T and out^T

  Preference pref;
  check(cublasLtMatmulPreferenceCreate(&pref.h), "cublasLtMatmulPreferenceCreate");
  set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(at::cuda::getCUDABlasLtWorkspaceSize()),
      "MAX_WORKSPACE_BYTES");
  set(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reduction_mask(dtype), "REDUCTION_SCHEME_MASK");
  set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(weight.data_ptr()), "MIN_ALIGNMENT_A_BYTES");
  set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(x.data_ptr()), "MIN_ALIGNMENT_B_BYTES");
  set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(residual.data_ptr()), "MIN_ALIGNMENT_C_BYTES");
  set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(d.data_ptr()), "MIN_ALIGNMENT_D_BYTES");

  const auto handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  const auto status = cublasLtMatmulAlgoGetHeuristic(handle, desc.h, a_layout.h, b_layout.h, cd_layout.h, cd_layout.h,
                                                     pref.h, 1, &heuristic, &found);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0)) return false;
  check(status, "cublasLtMatmulAlgoGetHeuristic");

  // From the caching allocator, on this stream: stream-ordered reuse, and capturable.
  at::Tensor workspace;
  if (heuristic.workspaceSize > 0)
    workspace = at::empty({static_cast<int64_t>(heuristic.workspaceSize)}, x.options().dtype(at::kByte));
  const float alpha = 1.0f, beta = 1.0f;
  check(cublasLtMatmul(handle, desc.h, &alpha, weight.data_ptr(), a_layout.h, x.data_ptr(), b_layout.h, &beta,
                       residual.data_ptr(), cd_layout.h, d.data_ptr(), cd_layout.h, &heuristic.algo,
                       workspace.defined() ? workspace.data_ptr() : nullptr, heuristic.workspaceSize,
                       at::cuda::getCurrentCUDAStream(device.index()).stream()),
        "cublasLtMatmul");
  out = std::move(d);
  return true;
}

}  // namespace diffract::models
