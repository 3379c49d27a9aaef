#include "core/models/common/layer_norm.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "core/util/options.h"

#ifdef DIFFRACT_HAS_CUDA_KERNELS
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/models/common/layer_norm_kernels.h"
#include "core/models/common/kernel_dtype.h"
#include "core/util/error.h"
#endif

namespace diffract::models {

namespace {

std::atomic<bool>& fused_switch() {
  static std::atomic<bool> on{[] {
    return options::flag(options::Id::FusedLayerNorm);
  }()};
  return on;
}

std::atomic<int>& warps_per_row() {
  static std::atomic<int> w{0};
  return w;
}

bool add_switch() {
  static const bool on = [] {
    return options::flag(options::Id::FusedAddLayerNorm);
  }();
  return on;
}

#ifdef DIFFRACT_HAS_CUDA_KERNELS
// Whether the kernel takes these tensors, filling `a` but for x and y (a non-contiguous x is
// copied to a fresh, aligned tensor first). The kernel has no backward, and autocast runs
// layer_norm in fp32: both go to ATen.
bool kernel_case(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, kernels::LayerNormArgs& a) {
  if (!fused_switch() || !x.defined() || !x.is_cuda() || x.dim() < 1 || x.numel() == 0) return false;
  const auto dtype = kernel_dtype(x.scalar_type());
  if (!dtype) return false;
  a.dtype = *dtype;  // Float too: layer_norm_supported leaves it to ATen
  a.c = x.size(-1);
  a.rows = x.numel() / a.c;
  if (!kernels::layer_norm_supported(a.dtype, a.c)) return false;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  for (const auto* t : {&weight, &bias})
    if (!t->defined() || t->scalar_type() != x.scalar_type() || t->device() != x.device() || t->dim() != 1 ||
        t->size(0) != a.c || !t->is_contiguous() || !aligned(t->const_data_ptr()))
      return false;
  if (x.is_contiguous() && !aligned(x.const_data_ptr())) return false;
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() || bias.requires_grad())) return false;
  if (at::autocast::is_autocast_enabled(at::kCUDA)) return false;
  a.weight = weight.const_data_ptr();
  a.bias = bias.const_data_ptr();
  a.sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  a.warps_per_row = warps_per_row();
  return true;
}

void launch(const kernels::LayerNormArgs& a, const c10::Device& device, const char* what) {
  const int rc = kernels::layer_norm_forward(a, at::cuda::getCurrentCUDAStream(device.index()).stream());
  if (rc != 0)
    throw Error(std::string(what) + " CUDA kernel failed to launch: " +
                std::string(cudaGetErrorString(static_cast<cudaError_t>(rc))));
}
#endif

}  // namespace

void set_fused_layer_norm(bool on) { fused_switch() = on; }

void set_layer_norm_warps_per_row(int warps) { warps_per_row() = warps; }

bool fused_layer_norm_available() {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  return fused_switch();
#else
  return false;
#endif
}

bool layer_norm_uses_kernel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  kernels::LayerNormArgs a;
  return kernel_case(x, weight, bias, a);
#else
  (void)x, (void)weight, (void)bias;
  return false;
#endif
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  TORCH_CHECK(x.dim() >= 1, "layer_norm: a 0-d input");
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  kernels::LayerNormArgs a;
  if (kernel_case(x, weight, bias, a)) {
    const c10::cuda::CUDAGuard guard(x.device());
    const auto in = x.contiguous();
    auto y = at::empty(in.sizes(), in.options());
    a.x = in.const_data_ptr();
    a.y = y.mutable_data_ptr();
    a.eps = static_cast<float>(eps);
    launch(a, x.device(), "LayerNorm");
    return y;
  }
#endif
  return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
}

std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor& weight, const at::Tensor& bias, double eps) {
  TORCH_CHECK(x.dim() >= 1, "add_layer_norm: a 0-d input");
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  kernels::LayerNormArgs a;
  if (add_switch() && residual.defined() && residual.sizes() == x.sizes() &&
      residual.scalar_type() == x.scalar_type() && residual.device() == x.device() &&
      !(at::GradMode::is_enabled() && residual.requires_grad()) && kernel_case(x, weight, bias, a)) {
    const c10::cuda::CUDAGuard guard(x.device());
    const auto in = x.contiguous(), r = residual.contiguous();
    const auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; };
    if (aligned(in) && aligned(r)) {
      auto sum = at::empty(in.sizes(), in.options());
      auto y = at::empty(in.sizes(), in.options());
      a.x = in.const_data_ptr();
      a.residual = r.const_data_ptr();
      a.sum = sum.mutable_data_ptr();
      a.y = y.mutable_data_ptr();
      a.eps = static_cast<float>(eps);
      launch(a, x.device(), "add + LayerNorm");
      return {sum, y};
    }
  }
#endif
  // The residual stream first (residual + x): an add's output takes its first operand's
  // strides, and with x first AsyncDiff's CPU results differ from one device's.
  auto sum = residual + x;
  auto y = layer_norm(sum, weight, bias, eps);
  return {sum, y};
}

LayerNormImpl::LayerNormImpl(const LayerNormOptions& o) : options(o) {
  weight = register_parameter("weight", at::ones({o.dim}));
  bias = register_parameter("bias", at::zeros({o.dim}));
}

at::Tensor LayerNormImpl::forward(const at::Tensor& x) { return layer_norm(x, weight, bias, options.eps_); }

std::pair<at::Tensor, at::Tensor> LayerNormImpl::forward_add(const at::Tensor& x, const at::Tensor& residual) {
  return add_layer_norm(x, residual, weight, bias, options.eps_);
}

}  // namespace diffract::models
