#include "core/models/common/geglu.h"

#include <atomic>
#include <optional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#ifdef DIFFRACT_HAS_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/models/common/geglu_kernels.h"
#include "core/models/common/kernel_dtype.h"
#endif
#include "core/models/common/strided_rows.h"
#include "core/util/error.h"
#include "core/util/options.h"

namespace diffract::models {

namespace {
std::atomic<bool> g_fused{true};
}  // namespace

void set_fused_geglu(bool on) { g_fused = on; }

bool fused_geglu_available() {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  return g_fused;
#else
  return false;
#endif
}

bool geglu_halves_uses_kernel(const at::Tensor& y) {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  const bool grad = at::GradMode::is_enabled() && y.requires_grad();
  return y.is_cuda() && g_fused && !grad && y.dim() >= 1 && y.size(-1) % 2 == 0 && y.is_contiguous() &&
         kernel_dtype(y.scalar_type());
#else
  (void)y;
  return false;
#endif
}

namespace {

// x's and out's rows where gelu_tanh_out's kernel takes them, nothing otherwise.
std::optional<std::pair<StridedRows, StridedRows>> gelu_kernel_rows([[maybe_unused]] const at::Tensor& out,
                                                                    [[maybe_unused]] const at::Tensor& x) {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  static const bool on = options::flag(options::Id::GeluSliceKernel);  // process scope: read once
  if (!on || !x.is_cuda() || !g_fused || (at::GradMode::is_enabled() && x.requires_grad())) return std::nullopt;
  if (out.device() != x.device() || out.sizes() != x.sizes() || out.scalar_type() != x.scalar_type() ||
      !kernel_dtype(x.scalar_type()))
    return std::nullopt;
  const auto xr = strided_rows(x), outr = strided_rows(out);
  // Rows of out that overlap would be written by several threads; out over part of x would be
  // read after it is written (ATen's gelu_out refuses that case with its own message).
  if (!xr || !outr || xr->rows != outr->rows || (outr->rows > 1 && outr->stride < outr->cols) ||
      at::get_overlap_status(out, x) == at::MemOverlapStatus::Partial)
    return std::nullopt;
  return std::pair{*xr, *outr};
#else
  return std::nullopt;
#endif
}

}  // namespace

bool gelu_tanh_uses_kernel(const at::Tensor& out, const at::Tensor& x) { return gelu_kernel_rows(out, x).has_value(); }

void gelu_tanh_out(at::Tensor& out, const at::Tensor& x) {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  if (const auto rows = gelu_kernel_rows(out, x)) {
    const auto& [xr, outr] = *rows;
    const c10::cuda::CUDAGuard guard(x.device());
    const int rc = kernels::gelu_tanh_rows_forward(x.data_ptr(), xr.stride, out.data_ptr(), outr.stride, xr.rows, xr.cols,
                                                   *kernel_dtype(x.scalar_type()),
                                                   at::cuda::getCurrentCUDAStream(x.device().index()).stream());
    if (rc != 0)
      throw Error("GELU CUDA kernel failed to launch: " + std::string(cudaGetErrorString(static_cast<cudaError_t>(rc))));
    return;
  }
#endif
  at::gelu_out(out, x, "tanh");
}

at::Tensor geglu_halves(const at::Tensor& y) {
  if (y.dim() < 1 || y.size(-1) % 2 != 0)
    throw Error("geglu_halves: the last dimension must be even (a then b), got " + c10::str(y.sizes()));
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  if (geglu_halves_uses_kernel(y)) {
    const c10::cuda::CUDAGuard guard(y.device());
    auto sizes = y.sizes().vec();
    const int64_t inner = sizes.back() / 2;
    sizes.back() = inner;
    auto out = at::empty(sizes, y.options());
    const int rc = kernels::geglu_halves_forward(y.data_ptr(), out.data_ptr(), y.numel() / (2 * inner), inner,
                                                 *kernel_dtype(y.scalar_type()),
                                                 at::cuda::getCurrentCUDAStream(y.device().index()).stream());
    if (rc != 0)
      throw Error("GEGLU CUDA kernel failed to launch: " + std::string(cudaGetErrorString(static_cast<cudaError_t>(rc))));
    return out;
  }
#endif
  const auto h = y.chunk(2, -1);
  return h[0] * at::gelu(h[1]);
}

at::Tensor geglu(const at::Tensor& a, const at::Tensor& b) {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  // The kernel records nothing for autograd: training takes ATen's ops.
  const bool grad = at::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad());
  if (a.is_cuda() && g_fused && !grad && a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && a.is_contiguous() &&
      b.is_contiguous()) {
    if (const auto dtype = kernel_dtype(a.scalar_type())) {
      const c10::cuda::CUDAGuard guard(a.device());
      auto out = at::empty_like(a);
      const int rc = kernels::geglu_forward(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(), *dtype,
                                            at::cuda::getCurrentCUDAStream(a.device().index()).stream());
      if (rc != 0)
        throw Error("GEGLU CUDA kernel failed to launch: " + std::string(cudaGetErrorString(static_cast<cudaError_t>(rc))));
      return out;
    }
  }
#endif
  return a * at::gelu(b);
}

}  // namespace diffract::models
