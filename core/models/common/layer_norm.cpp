#include "core/models/common/layer_norm.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "core/util/options.h"

#ifdef DIFFRACT_HAS_CUDA_KERNELS
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/models/common/fp8_linear.h"
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

[[maybe_unused]] bool modulation_switch() {
  static const bool on = options::flag(options::Id::FusedModulation);  // process scope: read once
  return on;
}

// ATen's ops: the path off CUDA (and where the kernels do not apply), and what they round like.
at::Tensor aten_plain_layer_norm(const at::Tensor& x, double eps) { return at::layer_norm(x, {x.size(-1)}, {}, {}, eps); }

at::Tensor aten_modulate(const at::Tensor& normed, const at::Tensor& scale, const at::Tensor& shift) {
  return normed * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

at::Tensor aten_gated_residual(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y) {
  return x + gate.unsqueeze(1) * y;
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

void check_launch(int rc, const char* what) {
  if (rc != 0)
    throw Error(std::string(what) + " CUDA kernel failed to launch: " +
                std::string(cudaGetErrorString(static_cast<cudaError_t>(rc))));
}

// Launches the kernel writing y; where an fp8 GEMM will read y (fp8_rows_wanted), its e4m3 rows
// too, offered to that GEMM (fp8_linear.h).
void launch(kernels::LayerNormArgs a, const at::Tensor& y, const char* what) {
  std::optional<Fp8Rows> rows;
  if (fp8_rows_wanted(y)) {  // bf16 only, as the kernel's rows
    rows = Fp8Rows{at::empty({a.rows, a.c}, y.options().dtype(at::kFloat8_e4m3fn)),
                   at::empty({a.rows, 1}, y.options().dtype(at::kFloat))};
    a.q = rows->q.mutable_data_ptr();
    a.q_scale = rows->scale.mutable_data_ptr<float>();
  }
  check_launch(kernels::layer_norm_forward(a, at::cuda::getCurrentCUDAStream(y.device().index()).stream()), what);
  if (rows) offer_fp8_rows(y, std::move(*rows));
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; }

// Whether the modulation kernels take x [B, T, D], with y (when given) of x's shape, type and
// device, and per-batch rows `per_batch` ([B, D] or [1, D] each, unit stride along D); the batch
// strides (0 for a [1, D] row) go to `strides`.
bool modulation_case(const at::Tensor& x, const at::Tensor* y, std::initializer_list<const at::Tensor*> per_batch,
                     std::vector<int64_t>& strides) {
  if (!modulation_switch() || !fused_switch() || !x.defined() || !x.is_cuda() || x.dim() != 3 || x.numel() == 0)
    return false;
  const auto dtype = kernel_dtype(x.scalar_type());
  if (!dtype || !kernels::layer_norm_supported(*dtype, x.size(2))) return false;
  if (at::autocast::is_autocast_enabled(at::kCUDA)) return false;
  const bool grad = at::GradMode::is_enabled();
  if (grad && x.requires_grad()) return false;
  if (y && (!y->defined() || y->sizes() != x.sizes() || y->scalar_type() != x.scalar_type() ||
            y->device() != x.device() || (grad && y->requires_grad())))
    return false;
  strides.clear();
  for (const auto* t : per_batch) {
    if (!t->defined() || t->scalar_type() != x.scalar_type() || t->device() != x.device() || t->dim() != 2 ||
        t->size(1) != x.size(2) || t->stride(1) != 1 || (t->size(0) != x.size(0) && t->size(0) != 1) ||
        !aligned16(*t) || (grad && t->requires_grad()))
      return false;
    const int64_t stride = t->size(0) == 1 ? 0 : t->stride(0);
    if (stride % 8 != 0) return false;
    strides.push_back(stride);
  }
  return true;
}

// A contiguous, 16-byte aligned form of t (a copy where t is neither).
at::Tensor contiguous_aligned(const at::Tensor& t) {
  auto c = t.contiguous();
  return aligned16(c) ? c : c.clone();
}

// The modulated LayerNorm kernel on x (and, with y and gate, the gated residual first): {sum, out}.
std::pair<at::Tensor, at::Tensor> launch_modulation(const at::Tensor& x, const at::Tensor* gate, const at::Tensor* y,
                                                    const at::Tensor& scale, const at::Tensor& shift,
                                                    const std::vector<int64_t>& strides, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto in = contiguous_aligned(x);
  kernels::LayerNormArgs a;
  a.dtype = *kernel_dtype(x.scalar_type());
  a.c = x.size(2);
  a.rows = x.numel() / a.c;
  a.rows_per_batch = x.size(1);
  a.sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  a.warps_per_row = warps_per_row();
  a.eps = static_cast<float>(eps);
  a.x = in.const_data_ptr();
  a.weight = scale.const_data_ptr();
  a.bias = shift.const_data_ptr();
  a.scale_stride = strides[0];
  a.shift_stride = strides[1];
  at::Tensor r, sum;
  if (gate) {
    r = contiguous_aligned(*y);
    sum = at::empty(in.sizes(), in.options());
    a.residual = r.const_data_ptr();
    a.sum = sum.mutable_data_ptr();
    a.gate = gate->const_data_ptr();
    a.gate_stride = strides[2];
  }
  auto out = at::empty(in.sizes(), in.options());
  a.y = out.mutable_data_ptr();
  launch(a, out, gate ? "gated residual + modulated LayerNorm" : "modulated LayerNorm");
  return {sum, out};
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
    launch(a, y, "LayerNorm");
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
      launch(a, y, "add + LayerNorm");
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

bool modulation_uses_kernel(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift) {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  std::vector<int64_t> strides;
  return modulation_case(x, nullptr, {&scale, &shift}, strides);
#else
  (void)x, (void)scale, (void)shift;
  return false;
#endif
}

std::vector<at::Tensor> modulated_layer_norms(const at::Tensor& x,
                                              const std::vector<std::pair<at::Tensor, at::Tensor>>& modulations,
                                              double eps) {
  TORCH_CHECK(x.dim() == 3, "modulated_layer_norm: x must be [B, T, D], got ", x.sizes());
  std::vector<at::Tensor> out;
  at::Tensor normed;  // ATen's, made once for the modulations the kernel does not take
  for (const auto& [scale, shift] : modulations) {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
    std::vector<int64_t> strides;
    if (modulation_case(x, nullptr, {&scale, &shift}, strides)) {
      out.push_back(launch_modulation(x, nullptr, nullptr, scale, shift, strides, eps).second);
      continue;
    }
#endif
    if (!normed.defined()) normed = aten_plain_layer_norm(x, eps);
    out.push_back(aten_modulate(normed, scale, shift));
  }
  return out;
}

at::Tensor modulated_layer_norm(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double eps) {
  return modulated_layer_norms(x, {{scale, shift}}, eps).front();
}

at::Tensor gated_residual(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y) {
  TORCH_CHECK(x.dim() == 3, "gated_residual: x must be [B, T, D], got ", x.sizes());
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  std::vector<int64_t> strides;
  if (modulation_case(x, &y, {&gate}, strides)) {
    const c10::cuda::CUDAGuard guard(x.device());
    const auto in = contiguous_aligned(x), other = contiguous_aligned(y);
    auto out = at::empty(in.sizes(), in.options());
    kernels::GatedResidualArgs a;
    a.dtype = *kernel_dtype(x.scalar_type());
    a.c = x.size(2);
    a.rows = x.numel() / a.c;
    a.rows_per_batch = x.size(1);
    a.gate_stride = strides[0];
    a.x = in.const_data_ptr();
    a.y = other.const_data_ptr();
    a.gate = gate.const_data_ptr();
    a.out = out.mutable_data_ptr();
    check_launch(kernels::gated_residual_forward(a, at::cuda::getCurrentCUDAStream(x.device().index()).stream()),
                 "gated residual");
    return out;
  }
#endif
  return aten_gated_residual(x, gate, y);
}

std::pair<at::Tensor, at::Tensor> gated_residual_modulated_layer_norm(const at::Tensor& x, const at::Tensor& gate,
                                                                      const at::Tensor& y, const at::Tensor& scale,
                                                                      const at::Tensor& shift, double eps) {
  TORCH_CHECK(x.dim() == 3, "gated_residual_modulated_layer_norm: x must be [B, T, D], got ", x.sizes());
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  std::vector<int64_t> strides;
  if (modulation_case(x, &y, {&scale, &shift, &gate}, strides))
    return launch_modulation(x, &gate, &y, scale, shift, strides, eps);
#endif
  auto h = aten_gated_residual(x, gate, y);
  auto n = aten_modulate(aten_plain_layer_norm(h, eps), scale, shift);
  return {h, n};
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
