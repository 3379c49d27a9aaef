#include "core/models/common/linear_residual.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>

namespace diffract::models {

namespace {
// Off unless DIFFRACT_FUSED_RESIDUAL=1. With cuBLASLt's first pick it lost (SDXL's step 1.55 ms
// slower in GEMMs against 1.0 ms of adds saved, seventh session). Each case now takes the
// fastest of ATen's ops and cuBLASLt's candidates, timed when first seen: SDXL 1024²'s graphed
// step 1.0 % faster at batch 2, 2.0 % at batch 1 on an H200, but the image no faster end to end
// (within the runs' noise) and the loop's peak memory 0.68 GB higher, not yet explained
// (docs/benchmarks.md, ninth session).
bool fused_from_env() {
  const char* env = std::getenv("DIFFRACT_FUSED_RESIDUAL");
  return env && std::string(env) == "1";
}
std::atomic<bool> g_fused{fused_from_env()};
}  // namespace

#ifdef DIFFRACT_HAS_CUBLASLT
// linear_residual_cuda.cpp: false when cuBLASLt does not take this case.
bool fused_linear_residual_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                const at::Tensor& residual, at::Tensor& out);
#endif

bool fused_linear_residual_available() {
#ifdef DIFFRACT_HAS_CUBLASLT
  return g_fused;
#else
  return false;
#endif
}

void set_fused_linear_residual(bool on) { g_fused = on; }

#ifndef DIFFRACT_HAS_CUBLASLT
int lt_gemm_candidates(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int) { return 0; }
bool lt_gemm(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int, at::Tensor&) {
  return false;
}
#endif

bool try_fused_linear_residual(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& residual, at::Tensor& out) {
#ifdef DIFFRACT_HAS_CUBLASLT
  // The GEMM records nothing for autograd: training runs ATen's ops.
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() ||
                                                   (bias.defined() && bias.requires_grad()) || residual.requires_grad());
  return g_fused && x.is_cuda() && !grad && fused_linear_residual_cuda(x, weight, bias, residual, out);
#else
  return false;
#endif
}

at::Tensor linear_residual(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& residual) {
  at::Tensor out;
  if (try_fused_linear_residual(x, weight, bias, residual, out)) return out;
  // The ops the blocks ran before, out of place (an in-place add changed AsyncDiff's CPU results
  // beyond their tests' tolerance, through the allocation pattern).
  return residual + at::linear(x, weight, bias);
}

}  // namespace diffract::models
