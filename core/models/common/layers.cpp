#include "core/models/common/layers.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include "core/models/common/patch_parallel.h"

namespace diffract::models {

namespace {

uint64_t next_construction_index() {
  static std::atomic<uint64_t> count{0};
  return count++;
}

}  // namespace

LinearImpl::LinearImpl(const LinearOptions& o) : options(o), construction_index(next_construction_index()) {
  weight = register_parameter("weight", at::empty({o.out_features, o.in_features}));
  if (o.with_bias) bias = register_parameter("bias", at::empty({o.out_features}));
}

at::Tensor LinearImpl::forward(const at::Tensor& x) { return at::linear(x, weight, bias); }

Conv2dImpl::Conv2dImpl(const Conv2dOptions& o) : options(o), construction_index(next_construction_index()) {
  weight = register_parameter("weight", at::empty({o.out_channels, o.in_channels, o.kernel, o.kernel}));
  if (o.with_bias) bias = register_parameter("bias", at::empty({o.out_channels}));
}

at::Tensor Conv2dImpl::forward(const at::Tensor& x) {
  if (options.kernel > 1)
    if (auto* patch = patch_context()) return patch->conv2d(*this, x);
  return at::conv2d(x, weight, bias, {options.stride_, options.stride_}, {options.padding_, options.padding_});
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
bool fused_group_norm_cuda(const at::Tensor& x, const at::Tensor& add, const at::Tensor& weight, const at::Tensor& bias,
                           int64_t groups, double eps, bool silu, at::Tensor& out);
bool fused_group_norm_available() { return true; }
#else
bool fused_group_norm_available() { return false; }
#endif
void set_fused_group_norm(bool on) { g_fused_group_norm = on; }
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

at::Tensor GroupNormImpl::forward(const at::Tensor& x, const at::Tensor& add, bool silu) {
  if (auto* patch = patch_context()) return patch->group_norm(*this, x, add, silu);
#ifdef DIFFRACT_HAS_CUDA_KERNELS
  at::Tensor out;
  // The kernels record nothing for autograd: training takes ATen's ops.
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() || bias.requires_grad() ||
                                                   (add.defined() && add.requires_grad()));
  if (x.is_cuda() && g_fused_group_norm && !grad &&
      fused_group_norm_cuda(x, add, weight, bias, options.groups, options.eps_, silu, out))
    return out;
#endif
  auto in = x;
  if (add.defined()) {
    std::vector<int64_t> shape(x.dim(), 1);
    shape[0] = add.size(0);
    shape[1] = add.size(1);
    in = x + add.view(shape);
  }
  auto y = at::group_norm(in, options.groups, weight, bias, options.eps_);
  return silu ? at::silu(y) : y;
}

namespace {

// Fills `p` from `fill` applied to an fp32 CPU tensor of its shape (or to p itself when it is one).
template <class Fill>
void draw(at::Tensor& p, Fill fill) {
  if (p.device().is_cpu() && p.scalar_type() == at::kFloat) {
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
  draw(w, [&](at::Tensor& t) { t.uniform_(-bound, bound, gen); });
  if (b.defined()) {
    const auto bias_bound = 1 / std::sqrt(fan_in);
    draw(b, [&](at::Tensor& t) { t.uniform_(-bias_bound, bias_bound, gen); });
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
      draw(e->weight, [&](at::Tensor& t) { t.normal_(0, 1, generator); });
    }
  }
}

void init_random(torch::nn::Module& module, uint64_t seed) {
  init_random(module, at::make_generator<at::CPUGeneratorImpl>(seed));
}

}  // namespace diffract::models
