#include "core/models/common/layers.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include "core/models/common/fp8_linear.h"
#include "core/models/common/patch_parallel.h"
#include "core/models/common/strided_rows.h"
#include "core/util/error.h"
#include "core/util/options.h"

#ifdef DIFFRACT_HAS_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "core/models/common/bias_add_kernels.h"
#include "core/models/common/kernel_dtype.h"
#endif

namespace diffract::models {

namespace {

uint64_t next_construction_index() {
  static std::atomic<uint64_t> count{0};
  return count++;
}

std::atomic<bool>& conv_bias_switch() {
  static std::atomic<bool> on{[] {
    return options::flag(options::Id::ConvBiasKernel);
  }()};
  return on;
}

// y += bias[channel] (+ residual) in place through the kernel, where it takes these tensors.
bool bias_add_cuda(at::Tensor& y, const at::Tensor& bias, const at::Tensor& residual, const at::Tensor& residual_bias) {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  if (!conv_bias_switch() || !y.is_cuda() || y.dim() != 4 || y.numel() == 0) return false;
  kernels::BiasAddArgs a;
  const auto dtype = kernel_dtype(y.scalar_type());
  if (!dtype) return false;
  a.dtype = *dtype;
  if (at::GradMode::is_enabled() && (y.requires_grad() || bias.requires_grad() || (residual.defined() && residual.requires_grad())))
    return false;
  if (bias.dim() != 1 || bias.size(0) != y.size(1) || bias.scalar_type() != y.scalar_type() ||
      bias.device() != y.device() || !bias.is_contiguous())
    return false;
  const int per = static_cast<int>(16 / y.element_size());
  a.c = y.size(1);
  if (y.is_contiguous(at::MemoryFormat::ChannelsLast) && y.size(1) % per == 0) a.plane = 1;
  else if (y.is_contiguous() && (y.size(2) * y.size(3)) % per == 0) a.plane = y.size(2) * y.size(3);
  else return false;
  if (residual.defined() && (residual.sizes() != y.sizes() || residual.strides() != y.strides() ||
                             residual.scalar_type() != y.scalar_type() || residual.device() != y.device()))
    return false;
  if (residual_bias.defined() && (!residual.defined() || residual_bias.sizes() != bias.sizes() ||
                                  residual_bias.scalar_type() != y.scalar_type() ||
                                  residual_bias.device() != y.device() || !residual_bias.is_contiguous() ||
                                  (at::GradMode::is_enabled() && residual_bias.requires_grad())))
    return false;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!aligned(y.const_data_ptr()) || !aligned(bias.const_data_ptr()) ||
      (residual.defined() && !aligned(residual.const_data_ptr())) ||
      (residual_bias.defined() && !aligned(residual_bias.const_data_ptr())))
    return false;
  a.y = y.mutable_data_ptr();
  a.bias = bias.const_data_ptr();
  a.residual = residual.defined() ? residual.const_data_ptr() : nullptr;
  a.residual_bias = residual_bias.defined() ? residual_bias.const_data_ptr() : nullptr;
  a.numel = y.numel();
  const c10::cuda::CUDAGuard guard(y.device());
  const int rc = kernels::bias_add(a, at::cuda::getCurrentCUDAStream(y.device().index()).stream());
  if (rc != 0)
    throw Error("convolution bias CUDA kernel failed to launch: " +
                std::string(cudaGetErrorString(static_cast<cudaError_t>(rc))));
  return true;
#else
  (void)y, (void)bias, (void)residual, (void)residual_bias;
  return false;
#endif
}

}  // namespace

bool conv_bias_kernel_available() {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  return conv_bias_switch();
#else
  return false;
#endif
}

void set_conv_bias_kernel(bool on) { conv_bias_switch() = on; }

LinearImpl::LinearImpl(const LinearOptions& o) : options(o), construction_index(next_construction_index()) {
  weight = register_parameter("weight", at::empty({o.out_features, o.in_features}));
  if (o.with_bias) bias = register_parameter("bias", at::empty({o.out_features}));
}

at::Tensor LinearImpl::forward(const at::Tensor& x) {
  if (fp8) {
    auto y = fp8_linear(x, fp8.get(), weight, bias);
    if (y.defined()) return y;
  }
  return linear(x, weight, bias);
}

#ifdef DIFFRACT_HAS_CUDA_KERNELS
// gemm_cuda.cpp: false when the tuned path does not take the case.
bool tuned_linear_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& out,
                       bool gelu = false);
bool tuned_linear_batched_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& out);
bool tuned_conv2d_cuda(const at::Tensor& x, const at::Tensor& w, int64_t stride, int64_t padding, at::Tensor& out);
#else
bool gemm_tuning_enabled() { return false; }
void set_gemm_tuning(bool) {}
std::string gemm_tuning_report() { return "[]"; }
std::string conv_tuning_report() { return "[]"; }
std::string tuning_stats() { return "{}"; }
void save_tuning() {}
#endif

at::Tensor conv2d(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t stride,
                  int64_t padding) {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  if (x.is_cuda() && x.dim() == 4 && !at::GradMode::is_enabled()) {
    at::Tensor out;
    if (tuned_conv2d_cuda(x, weight, stride, padding, out)) {
      if (bias.defined()) out.add_(bias.view({1, -1, 1, 1}));
      return out;
    }
  }
#endif
  return at::conv2d(x, weight, bias, {stride, stride}, {padding, padding});
}

namespace {

// x, or on CUDA a contiguous copy of x where its rows fold into no single stride (SD3's image
// tokens sliced from its joint sequence, batch 2). at::linear copies such an input too, then runs
// the GEMM without the bias and adds it in a pass of its own; the copy lets the tuned GEMM (or
// at::linear's addmm) add it in the epilogue. Transposed inputs and 2-D column slices stay as they
// are: the GEMMs read them in place.
at::Tensor gemm_input(const at::Tensor& x) {
  if (!x.is_cuda() || x.is_contiguous() || x.dim() < 3 || x.stride(-1) != 1 || strided_rows(x)) return x;
  return x.contiguous();
}

// x @ W^T + b (gelu_tanh of it with `gelu`) through the tuned cuBLASLt GEMM, or undefined where
// that path does not take the case (not CUDA, x not contiguous, tuning off, autograd recording,
// or the timing kept ATen for the shape).
at::Tensor tuned_linear([[maybe_unused]] const at::Tensor& x, [[maybe_unused]] const at::Tensor& weight,
                        [[maybe_unused]] const at::Tensor& bias, [[maybe_unused]] bool gelu) {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  if (x.is_cuda() && x.dim() >= 2 && x.is_contiguous() && gemm_tuning_enabled() &&
      !(at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() ||
                                       (bias.defined() && bias.requires_grad())))) {
    at::Tensor out;
    if (tuned_linear_cuda(x.view({-1, x.size(-1)}), weight, bias, out, gelu)) {
      auto sizes = x.sizes().vec();
      sizes.back() = weight.size(0);
      return out.view(sizes);
    }
  }
#endif
  return {};
}

}  // namespace

bool gemm_strided_batch_enabled() {
  static const bool on = options::flag(options::Id::GemmStridedBatch);  // process scope: read once
  return on;
}

namespace {

// Whether x [B, T, K] is a case for the strided-batch GEMM: switched on, CUDA inference, each
// batch item's rows contiguous and adjacent (the callers send it only x or an out whose items lie
// apart: a plain GEMM takes the rest).
bool strided_batch_case(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return gemm_strided_batch_enabled() && x.is_cuda() && x.dim() == 3 && x.size(0) > 1 && x.size(1) > 0 && x.stride(2) == 1 &&
         x.stride(1) == x.size(2) && gemm_tuning_enabled() &&
         !(at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() ||
                                          (bias.defined() && bias.requires_grad())));
}

// The strided-batch GEMM into out [B, T, N]; false where it does not take the case.
bool batched_linear([[maybe_unused]] at::Tensor& out, [[maybe_unused]] const at::Tensor& x,
                    [[maybe_unused]] const at::Tensor& weight, [[maybe_unused]] const at::Tensor& bias) {
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  return out.dim() == 3 && tuned_linear_batched_cuda(x, weight, bias, out);
#else
  return false;
#endif
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!x.is_contiguous() && strided_batch_case(x, weight, bias)) {
    auto out = at::empty({x.size(0), x.size(1), weight.size(0)}, x.options());
    if (batched_linear(out, x, weight, bias)) return out;
  }
  const auto in = gemm_input(x);
  auto y = tuned_linear(in, weight, bias, /*gelu=*/false);
  return y.defined() ? y : at::linear(in, weight, bias);
}

void linear_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(out.dim() == x.dim() && out.sizes().slice(0, x.dim() - 1) == x.sizes().slice(0, x.dim() - 1) &&
                  out.size(-1) == weight.size(0),
              "linear_into: out ", out.sizes(), " for x ", x.sizes(), " and weight ", weight.sizes());
  if (!(x.is_contiguous() && out.is_contiguous()) && strided_batch_case(x, weight, bias) &&
      batched_linear(out, x, weight, bias))
    return;
  out.copy_(linear(x, weight, bias));
}

at::Tensor linear_gelu_tanh(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  static const bool in_epilogue = options::flag(options::Id::GemmGelu);  // process scope: read once
  const auto in = gemm_input(x);
  if (in_epilogue) {
    auto y = tuned_linear(in, weight, bias, /*gelu=*/true);
    if (y.defined()) return y;
  }
  return at::gelu(linear(in, weight, bias), "tanh");
}

Conv2dImpl::Conv2dImpl(const Conv2dOptions& o) : options(o), construction_index(next_construction_index()) {
  weight = register_parameter("weight", at::empty({o.out_channels, o.in_channels, o.kernel, o.kernel}));
  if (o.with_bias) bias = register_parameter("bias", at::empty({o.out_channels}));
}

at::Tensor Conv2dImpl::forward(const at::Tensor& x) { return forward_add(x, {}); }

at::Tensor Conv2dImpl::forward_add(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& residual_bias) {
  if (residual_bias.defined() &&
      (!residual.defined() || residual_bias.dim() != 1 || residual_bias.size(0) != options.out_channels))
    throw Error("Conv2d::forward_add: residual_bias of shape " + c10::str(residual_bias.sizes()) +
                (residual.defined() ? "" : " without a residual") + " (wants a residual and [" +
                std::to_string(options.out_channels) + "])");
  // The residual first, as in a ResNet block's skip + h: an add's output takes its first
  // operand's strides.
  const auto with_residual = [&](const at::Tensor& y) {
    if (!residual.defined()) return y;
    return residual_bias.defined() ? residual + residual_bias.view({1, -1, 1, 1}) + y : residual + y;
  };
  if (options.kernel > 1)
    if (auto* patch = patch_context_for_convolutions()) return with_residual(patch->conv2d(*this, x));
  if (bias.defined() && x.is_cuda() && conv_bias_switch()) {
    auto y = forward_without_bias(x);
    if (bias_add_cuda(y, bias, residual, residual_bias)) return y;
    return with_residual(y + bias.view({1, -1, 1, 1}));
  }
  return with_residual(conv2d(x, weight, bias, options.stride_, options.padding_));
}

at::Tensor Conv2dImpl::forward_without_bias(const at::Tensor& x) {
  if (options.kernel > 1 && patch_context_for_convolutions())
    throw Error("Conv2d::forward_without_bias: a patch-parallel context is active (its convolutions add the bias)");
  return conv2d(x, weight, {}, options.stride_, options.padding_);
}

EmbeddingImpl::EmbeddingImpl(int64_t num, int64_t dim)
    : num_embeddings(num), embedding_dim(dim), construction_index(next_construction_index()) {
  weight = register_parameter("weight", at::empty({num, dim}));
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& ids) { return at::embedding(weight, ids); }

namespace {
std::atomic<bool> g_fused_group_norm{true};
}  // namespace

#ifdef DIFFRACT_HAS_CUDA_KERNELS
// group_norm_cuda.cpp: false when the kernels do not take this case.
bool fused_group_norm_cuda(const at::Tensor& x, const at::Tensor& add, const at::Tensor& channel_add,
                           const at::Tensor& weight, const at::Tensor& bias, int64_t groups, double eps, bool silu,
                           at::Tensor& out);
bool fused_group_norm_available() { return true; }
#else
bool fused_group_norm_available() { return false; }
#endif
void set_fused_group_norm(bool on) { g_fused_group_norm = on; }

namespace {
// 2 by measurement (graphed, the SDXL step's channels-last shapes): faster than 4 at batch 1 and
// batch 2, 1 and 8 no better (docs/benchmarks.md).
// DIFFRACT_GROUP_NORM_STATS_BLOCKS sets another at start-up (A/B runs).
constexpr int kStatsBlocksPerSm = 2;
int stats_blocks_from_env() {
  const int n = options::integer(options::Id::GroupNormStatsBlocks);
  return n > 0 ? n : kStatsBlocksPerSm;
}
std::atomic<int> g_stats_blocks_per_sm{stats_blocks_from_env()};
}  // namespace
void set_group_norm_stats_blocks_per_sm(int blocks) { g_stats_blocks_per_sm = blocks > 0 ? blocks : kStatsBlocksPerSm; }
int group_norm_stats_blocks_per_sm() { return g_stats_blocks_per_sm; }
bool fused_group_norm_enabled() { return fused_group_norm_available() && g_fused_group_norm; }

void set_memory_format(torch::nn::Module& module, at::MemoryFormat format) {
  at::NoGradGuard no_grad;
  for (auto& w : module.parameters())
    if (w.dim() == 4) w.set_data(w.contiguous(format));
}

GroupNormImpl::GroupNormImpl(const GroupNormOptions& o) : options(o) {
  TORCH_CHECK(o.groups > 0 && o.channels % o.groups == 0, "GroupNorm: ", o.channels, " channels in ", o.groups,
              " groups");
  weight = register_parameter("weight", at::ones({o.channels}));
  bias = register_parameter("bias", at::zeros({o.channels}));
}

at::Tensor GroupNormImpl::forward(const at::Tensor& x, const at::Tensor& add, bool silu, const at::Tensor& channel_add) {
  if (add.defined() && (add.dim() != 2 || add.size(1) != x.size(1) || (add.size(0) != x.size(0) && add.size(0) != 1)))
    throw Error("GroupNorm: add of shape " + c10::str(add.sizes()) + " for input " + c10::str(x.sizes()) +
                " (wants [N, C] or [1, C])");
  if (channel_add.defined() && (channel_add.dim() != 1 || channel_add.size(0) != x.size(1)))
    throw Error("GroupNorm: channel_add of shape " + c10::str(channel_add.sizes()) + " for input " +
                c10::str(x.sizes()) + " (wants [C])");
  if (auto* patch = patch_context()) {
    const auto both = !channel_add.defined() ? add
                      : add.defined()        ? add + channel_add
                                             : channel_add.unsqueeze(0);
    return patch->group_norm(*this, x, both, silu);
  }
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  at::Tensor out;
  // The kernels record nothing for autograd: training takes ATen's ops.
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() || bias.requires_grad() ||
                                                   (add.defined() && add.requires_grad()) ||
                                                   (channel_add.defined() && channel_add.requires_grad()));
  if (x.is_cuda() && g_fused_group_norm && !grad &&
      fused_group_norm_cuda(x, add, channel_add, weight, bias, options.groups, options.eps_, silu, out))
    return out;
#endif
  auto in = x;
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = x.size(1);
  if (add.defined()) {
    shape[0] = add.size(0);
    in = in + add.reshape(shape);
  }
  if (channel_add.defined()) {
    shape[0] = 1;
    in = in + channel_add.view(shape);
  }
  auto y = at::group_norm(in, options.groups, weight, bias, options.eps_);
  return silu ? at::silu(y) : y;
}

namespace {

// Fills `p` from `fill` applied to an fp32 CPU tensor of its shape (or to p itself when it is one).
template <class Fill>
void draw(at::Tensor& p, Fill fill, const at::Generator& gen) {
  if ((p.device().is_cpu() && p.scalar_type() == at::kFloat) || (p.device().is_cuda() && gen.device() == p.device())) {
    fill(p);
  } else {
    auto host = at::empty(p.sizes(), at::TensorOptions().dtype(at::kFloat));
    fill(host);
    p.copy_(host);
  }
}

// torch::nn::init::kaiming_uniform_(w, sqrt(5)) then uniform_(b, -1/sqrt(fan_in), 1/sqrt(fan_in)),
// as LibTorch's Linear and Conv reset_parameters(), with the same double arithmetic.
void kaiming_pair(at::Tensor& w, at::Tensor& b, at::Generator& gen) {
  int64_t fan_in = w.size(1);  // _calculate_fan_in_and_fan_out: input maps x receptive field
  for (int64_t d = 2; d < w.dim(); ++d) fan_in *= w.size(d);
  const double a = std::sqrt(5.0);
  const double gain = std::sqrt(2.0 / (1 + std::pow(a, 2)));
  const double stddev = gain / std::sqrt(fan_in);
  const double bound = std::sqrt(3.0) * stddev;
  draw(w, [&](at::Tensor& t) { t.uniform_(-bound, bound, gen); }, gen);
  if (b.defined()) {
    const auto bias_bound = 1 / std::sqrt(fan_in);
    draw(b, [&](at::Tensor& t) { t.uniform_(-bias_bound, bias_bound, gen); }, gen);
  }
}

}  // namespace

void init_random(torch::nn::Module& module, at::Generator generator) {
  if (!generator.defined()) generator = at::detail::getDefaultCPUGenerator();
  std::vector<std::pair<uint64_t, torch::nn::Module*>> layers;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto* l = m->as<LinearImpl>()) layers.emplace_back(l->construction_index, l);
    else if (auto* c = m->as<Conv2dImpl>()) layers.emplace_back(c->construction_index, c);
    else if (auto* e = m->as<EmbeddingImpl>()) layers.emplace_back(e->construction_index, e);
  }
  std::sort(layers.begin(), layers.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  at::NoGradGuard no_grad;  // the draws lock the generator themselves
  for (const auto& [index, m] : layers) {
    if (auto* l = m->as<LinearImpl>()) {
      kaiming_pair(l->weight, l->bias, generator);
    } else if (auto* c = m->as<Conv2dImpl>()) {
      kaiming_pair(c->weight, c->bias, generator);
    } else if (auto* e = m->as<EmbeddingImpl>()) {
      draw(e->weight, [&](at::Tensor& t) { t.normal_(0, 1, generator); }, generator);
    }
  }
}

void empty_parameters_on(torch::nn::Module& module, const at::Device& device, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  std::set<const c10::TensorImpl*> layer_tensors;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    const auto add = [&](const at::Tensor& t) {
      if (t.defined()) layer_tensors.insert(t.unsafeGetTensorImpl());
    };
    if (auto* l = m->as<LinearImpl>()) add(l->weight), add(l->bias);
    else if (auto* c = m->as<Conv2dImpl>()) add(c->weight), add(c->bias);
    else if (auto* e = m->as<EmbeddingImpl>()) add(e->weight);
  }
  const auto opts = at::TensorOptions().device(device).dtype(dtype);
  for (auto& p : module.parameters(/*recurse=*/true))
    p.set_data(layer_tensors.count(p.unsafeGetTensorImpl()) ? at::empty(p.sizes(), opts) : p.to(opts));
  for (auto& b : module.buffers(/*recurse=*/true)) b.set_data(b.to(device));
}

void init_random(torch::nn::Module& module, uint64_t seed) {
  init_random(module, at::make_generator<at::CPUGeneratorImpl>(seed));
}

}  // namespace diffract::models
