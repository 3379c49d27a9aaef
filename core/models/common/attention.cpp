#include "core/models/common/attention.h"

#include <cstdlib>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/nn/modules/dropout.h>

#include "core/models/common/geglu.h"
#include "core/models/common/linear_residual.h"
#include "core/models/common/patch_parallel.h"
#include "core/util/error.h"

namespace diffract::models {

namespace {

// DIFFRACT_SDPA=flash takes cuDNN's attention (PyTorch's pick on Hopper) out of the running, so
// ATen's FlashAttention-2 runs; =efficient also FlashAttention, leaving the memory-efficient
// kernels. For A/B runs of the attention kernels (docs/benchmarks.md); read once per process.
void choose_attention_backend() {
  static const bool chosen = [] {
    const char* v = std::getenv("DIFFRACT_SDPA");
    const std::string choice = v ? v : "";
    if (choice == "flash" || choice == "efficient") at::globalContext().setSDPUseCuDNN(false);
    if (choice == "efficient") at::globalContext().setSDPUseFlash(false);
    return true;
  }();
  (void)chosen;
}

}  // namespace

at::Tensor multi_head_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads,
                                bool causal) {
  choose_attention_backend();
  const auto b = q.size(0), tq = q.size(1), tk = k.size(1), c = q.size(2);
  const auto d = c / heads;
  auto split = [&](const at::Tensor& x, int64_t t) { return x.view({b, t, heads, d}).transpose(1, 2); };
  auto out = at::scaled_dot_product_attention(split(q, tq), split(k, tk), split(v, tk), /*attn_mask=*/{},
                                              /*dropout_p=*/0.0, causal);
  return out.transpose(1, 2).reshape({b, tq, c});
}

Activation parse_activation(const std::string& name, const std::string& where) {
  if (name == "quick_gelu") return Activation::QuickGELU;
  if (name == "gelu") return Activation::GELU;
  if (name == "gelu_new" || name == "gelu_pytorch_tanh") return Activation::GELUTanh;
  if (name == "silu" || name == "swish") return Activation::SiLU;
  throw Error(where + ": unsupported activation '" + name + "' (quick_gelu, gelu, gelu_new, gelu_pytorch_tanh, silu)");
}

at::Tensor apply_activation(Activation act, const at::Tensor& x) {
  switch (act) {
    case Activation::QuickGELU: return x * at::sigmoid(x * 1.702);
    case Activation::GELU: return at::gelu(x);
    case Activation::GELUTanh: return at::gelu(x, "tanh");
    case Activation::SiLU: return at::silu(x);
  }
  return x;
}

namespace nn = torch::nn;

AttentionImpl::AttentionImpl(const AttentionOptions& o) : options(o) {
  const int64_t inner = o.heads * o.dim_head;
  const int64_t kv_dim = o.cross_attention_dim > 0 ? o.cross_attention_dim : o.query_dim;
  if (o.norm_num_groups > 0)
    group_norm = register_module(
        "group_norm", GroupNorm(GroupNormOptions(o.norm_num_groups, o.query_dim).eps(o.norm_eps)));
  to_q = register_module("to_q", Linear(LinearOptions(o.query_dim, inner).bias(o.bias)));
  to_k = register_module("to_k", Linear(LinearOptions(kv_dim, inner).bias(o.bias)));
  to_v = register_module("to_v", Linear(LinearOptions(kv_dim, inner).bias(o.bias)));
  to_out = register_module("to_out", nn::ModuleList(Linear(inner, o.query_dim), nn::Dropout(0.0)));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& context, const at::Tensor& residual) {
  const bool spatial = x.dim() == 4;
  if (residual.defined() && (spatial || options.residual_connection || options.rescale_output_factor != 1.0))
    throw Error("Attention: a residual for to_out.0 needs token input without residual_connection or rescaling");
  at::Tensor h = x;
  int64_t b = x.size(0), c = 0, height = 0, width = 0;
  if (spatial) {
    c = x.size(1), height = x.size(2), width = x.size(3);
    h = x.view({b, c, height * width}).transpose(1, 2);
  }
  if (group_norm) h = group_norm->forward(h.transpose(1, 2)).transpose(1, 2);
  at::Tensor q, k, v;
  if (!context.defined() && !at::GradMode::is_enabled() && qkv_fused()) {
    const auto inner = options.heads * options.dim_head;
    const auto qkv = at::linear(h, qkv_weight_, qkv_bias_);
    q = qkv.narrow(-1, 0, inner), k = qkv.narrow(-1, inner, inner), v = qkv.narrow(-1, 2 * inner, inner);
  } else {
    const at::Tensor& kv = context.defined() ? context : h;
    q = to_q->forward(h), k = to_k->forward(kv), v = to_v->forward(kv);
  }
  // Patch parallelism: this band's queries against the whole image's keys and values.
  if (!context.defined())
    if (auto* patch = patch_context()) std::tie(k, v) = patch->self_attention_kv(k, v);
  auto out = multi_head_attention(q, k, v, options.heads);
  auto* proj = to_out[0]->as<Linear>();
  out = residual.defined() ? linear_residual(out, proj->weight, proj->bias, residual) : proj->forward(out);
  if (spatial) out = out.transpose(1, 2).reshape({b, c, height, width});
  if (options.residual_connection) out = out + x;
  if (options.rescale_output_factor != 1.0) out = out / options.rescale_output_factor;
  return out;
}

bool AttentionImpl::fuse_qkv() {
  if (options.cross_attention_dim > 0) return false;
  const bool biased = to_q->bias.defined();
  if (biased != to_k->bias.defined() || biased != to_v->bias.defined()) return false;
  at::NoGradGuard no_grad;
  const auto inner = to_q->weight.size(0);
  qkv_weight_ = at::cat({to_q->weight, to_k->weight, to_v->weight}, 0);
  to_q->weight.set_data(qkv_weight_.narrow(0, 0, inner));
  to_k->weight.set_data(qkv_weight_.narrow(0, inner, inner));
  to_v->weight.set_data(qkv_weight_.narrow(0, 2 * inner, inner));
  qkv_bias_ = at::Tensor();
  if (biased) {
    qkv_bias_ = at::cat({to_q->bias, to_k->bias, to_v->bias}, 0);
    to_q->bias.set_data(qkv_bias_.narrow(0, 0, inner));
    to_k->bias.set_data(qkv_bias_.narrow(0, inner, inner));
    to_v->bias.set_data(qkv_bias_.narrow(0, 2 * inner, inner));
  }
  return true;
}

bool AttentionImpl::qkv_fused() const {
  if (!qkv_weight_.defined()) return false;
  // Still views of the fused tensors (a move to another device or dtype replaces them).
  const auto views = [](const at::Tensor& fused, std::initializer_list<const at::Tensor*> parts) {
    auto* base = static_cast<const char*>(fused.data_ptr());
    std::int64_t offset = 0;
    for (const auto* t : parts) {
      if (!t->defined() || t->data_ptr() != base + offset || t->scalar_type() != fused.scalar_type() ||
          t->device() != fused.device())
        return false;
      offset += t->numel() * static_cast<std::int64_t>(t->element_size());
    }
    return true;
  };
  return views(qkv_weight_, {&to_q->weight, &to_k->weight, &to_v->weight}) &&
         (!qkv_bias_.defined() || views(qkv_bias_, {&to_q->bias, &to_k->bias, &to_v->bias}));
}

int fuse_attention_qkv(torch::nn::Module& root) {
  int fused = 0;
  for (const auto& m : root.modules(/*include_self=*/true))
    if (auto* a = dynamic_cast<AttentionImpl*>(m.get())) fused += a->fuse_qkv() ? 1 : 0;
  return fused;
}

bool fused_qkv_wanted() {
  const char* v = std::getenv("DIFFRACT_FUSED_QKV");
  return v && std::string(v) == "1";
}

namespace {
// GEGLU's projection; a module of its own so the key reads net.0.proj.
class GEGLUImpl : public nn::Module {
 public:
  GEGLUImpl(int64_t dim, int64_t inner) { proj = register_module("proj", Linear(dim, inner * 2)); }
  // Two GEMMs over the halves of the weight rather than one whose output is chunked: each
  // half comes out contiguous, so the gate runs vectorised (on strided halves gelu and the
  // product ran as non-vectorised kernels, 5.1 ms of the SDXL step on an H200), on CUDA as one
  // kernel (geglu.h).
  at::Tensor forward(const at::Tensor& x) {
    const int64_t inner = proj->weight.size(0) / 2;
    const auto half = [&](int64_t i) {
      return at::linear(x, proj->weight.narrow(0, i * inner, inner),
                        proj->bias.defined() ? proj->bias.narrow(0, i * inner, inner) : at::Tensor());
    };
    return geglu(half(0), half(1));
  }
  Linear proj{nullptr};
};
TORCH_MODULE(GEGLU);

// diffusers' GELU(approximate="tanh") with its projection (net.0.proj).
class GELUProjImpl : public nn::Module {
 public:
  GELUProjImpl(int64_t dim, int64_t inner) { proj = register_module("proj", Linear(dim, inner)); }
  at::Tensor forward(const at::Tensor& x) { return at::gelu(proj->forward(x), "tanh"); }
  Linear proj{nullptr};
};
TORCH_MODULE(GELUProj);
}  // namespace

FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t inner_dim, FeedForwardActivation act) : activation(act) {
  const auto out = Linear(inner_dim, dim);
  if (act == FeedForwardActivation::GEGLU)
    net = register_module("net", nn::ModuleList(GEGLU(dim, inner_dim), nn::Dropout(0.0), out));
  else
    net = register_module("net", nn::ModuleList(GELUProj(dim, inner_dim), nn::Dropout(0.0), out));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x, const at::Tensor& residual) {
  const auto h = activation == FeedForwardActivation::GEGLU ? net[0]->as<GEGLU>()->forward(x)
                                                            : net[0]->as<GELUProj>()->forward(x);
  auto* out = net[2]->as<Linear>();
  return residual.defined() ? linear_residual(h, out->weight, out->bias, residual) : out->forward(h);
}

}  // namespace diffract::models
