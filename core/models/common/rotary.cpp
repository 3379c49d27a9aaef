#include "core/models/common/rotary.h"

#include <atomic>
#include <string>

#include <ATen/ATen.h>

#include "core/util/options.h"
#ifdef DIFFRACT_HAS_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/models/common/kernel_dtype.h"
#include "core/models/common/rotary_kernels.h"
#endif
#include "core/util/error.h"

namespace diffract::models {

namespace {

std::atomic<bool>& fused_switch() {
  static std::atomic<bool> on{options::flag(options::Id::FusedRmsNormRope)};
  return on;
}

}  // namespace

bool fused_rms_norm_rope_available() {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  return fused_switch();
#else
  return false;
#endif
}

void set_fused_rms_norm_rope(bool on) { fused_switch() = on; }

at::Tensor apply_rope(const at::Tensor& x, const Rope& rope) {
  // x [B, S, H, D]; cos / sin [S, D]
  const auto xf = x.to(at::kFloat);
  const auto pairs = xf.unflatten(-1, {-1, 2});  // [B, S, H, D/2, 2]
  const auto rotated = at::stack({-pairs.select(-1, 1), pairs.select(-1, 0)}, -1).flatten(3);
  const auto cos = rope.cos.unsqueeze(0).unsqueeze(2), sin = rope.sin.unsqueeze(0).unsqueeze(2);
  return (xf * cos + rotated * sin).to(x.scalar_type());
}

void rms_norm_rope_into(RMSNormImpl& norm, const at::Tensor& x, const Rope& rope, at::Tensor& out, int64_t offset) {
  TORCH_CHECK(x.dim() == 4 && out.dim() == 4 && x.size(0) == out.size(0) && x.size(2) == out.size(2) &&
                  x.size(3) == out.size(3) && offset >= 0 && offset + x.size(1) <= out.size(1) &&
                  offset + x.size(1) <= rope.cos.size(0),
              "rms_norm_rope_into: x ", x.sizes(), " at token ", offset, " does not fit out ", out.sizes(), " and the rope of ",
              rope.cos.size(0), " positions");
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || norm.weight.requires_grad());
  const auto dtype = kernel_dtype(x.scalar_type());
  if (x.is_cuda() && fused_switch() && !grad && dtype && *dtype != kernels::DType::Float &&
      norm.weight.scalar_type() == x.scalar_type() && x.stride(3) == 1 && out.is_contiguous() &&
      out.scalar_type() == x.scalar_type() && kernels::rms_norm_rope_supported(x.size(3)) &&
      rope.cos.scalar_type() == at::kFloat && rope.sin.scalar_type() == at::kFloat && rope.cos.is_contiguous() &&
      rope.sin.is_contiguous() && rope.cos.device() == x.device()) {
    const c10::cuda::CUDAGuard guard(x.device());
    const auto weight = norm.weight.contiguous();
    kernels::RmsNormRopeArgs a;
    a.x = x.data_ptr();
    a.x_stride_b = x.stride(0), a.x_stride_t = x.stride(1), a.x_stride_h = x.stride(2);
    a.weight = weight.data_ptr();
    a.cos = rope.cos.data_ptr<float>() + offset * rope.cos.size(1);
    a.sin = rope.sin.data_ptr<float>() + offset * rope.sin.size(1);
    a.out = static_cast<char*>(out.data_ptr()) + offset * out.stride(1) * out.element_size();
    a.out_stride_b = out.stride(0), a.out_stride_t = out.stride(1);
    a.batch = x.size(0), a.tokens = x.size(1), a.heads = x.size(2), a.dim = x.size(3);
    a.eps = static_cast<float>(norm.eps);
    a.dtype = *dtype;
    static const bool vectorise = options::flag(options::Id::RmsNormRopeVector);  // process scope: read once
    a.vectorise = vectorise;
    const int rc = kernels::rms_norm_rope_forward(a, at::cuda::getCurrentCUDAStream(x.device().index()).stream());
    if (rc != 0)
      throw Error("RMSNorm + rope CUDA kernel failed to launch: " +
                  std::string(cudaGetErrorString(static_cast<cudaError_t>(rc))));
    return;
  }
#endif
  const Rope part{rope.cos.narrow(0, offset, x.size(1)), rope.sin.narrow(0, offset, x.size(1))};
  out.narrow(1, offset, x.size(1)).copy_(apply_rope(norm.forward(x), part));
}

}  // namespace diffract::models
