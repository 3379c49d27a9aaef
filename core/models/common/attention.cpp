#include "core/models/common/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/nn/modules/dropout.h>

#include "core/models/common/cancel_point.h"
#include "core/models/common/fp8_linear.h"
#include "core/models/common/geglu.h"
#include "core/models/common/patch_parallel.h"
#include "core/util/error.h"
#include "core/util/options.h"

namespace diffract::models {

namespace {

// DIFFRACT_SDPA=flash takes cuDNN's attention (PyTorch's pick on Hopper) out of the running, so
// ATen's FlashAttention-2 runs; =efficient also FlashAttention, leaving the memory-efficient
// kernels. For A/B runs of the attention kernels (docs/benchmarks.md); read once per process.
void choose_attention_backend() {
  static const bool chosen = [] {
    const std::string choice = options::value(options::Id::Sdpa);
    if (choice == "flash" || choice == "efficient") at::globalContext().setSDPUseCuDNN(false);
    if (choice == "efficient") at::globalContext().setSDPUseFlash(false);
    return true;
  }();
  (void)chosen;
}

bool wide_heads_wanted() {
  static const bool on = [] {
    return options::flag(options::Id::WideHeadAttention);
  }();
  return on;
}

}  // namespace

at::Tensor wide_head_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t max_score_bytes) {
  // q [N, Tq, d], k, v [N, Tk, d] -> [N, Tq, d].
  const auto n = q.size(0), tq = q.size(1), tk = k.size(1), d = q.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const auto chunk = std::clamp<int64_t>(max_score_bytes / std::max<int64_t>(1, 4 * n * tk), 1, tq);
  // CUDA's GEMM writes fp32 scores from half inputs; elsewhere the inputs go to fp32 first.
  const bool gpu = q.is_cuda();
  const auto kt = gpu ? k.transpose(1, 2) : k.transpose(1, 2).to(at::kFloat);
  auto out = at::empty({n, tq, d}, q.options());
  for (int64_t begin = 0; begin < tq; begin += chunk) {
    const auto rows = std::min(chunk, tq - begin);
    const auto qc = q.narrow(1, begin, rows);
    auto scores = gpu ? at::bmm(qc, kt, at::kFloat) : at::bmm(qc.to(at::kFloat), kt);
    scores.mul_(scale);
    auto p = at::softmax(scores, -1).to(v.scalar_type());
    out.narrow(1, begin, rows).copy_(at::bmm(p, v));
  }
  return out;
}

at::Tensor multi_head_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads,
                                bool causal) {
  choose_attention_backend();
  const auto b = q.size(0), tq = q.size(1), tk = k.size(1), c = q.size(2);
  const auto d = c / heads;
  auto split = [&](const at::Tensor& x, int64_t t) { return x.view({b, t, heads, d}).transpose(1, 2); };
  // Heads wider than FlashAttention's and cuDNN's 256 (the VAE's one 512-wide head) go to SDPA's
  // memory-efficient kernel, far below the GPU's peak (docs/benchmarks.md).
  if (q.is_cuda() && d > 256 && !causal && q.scalar_type() != at::kFloat && !at::GradMode::is_enabled() &&
      wide_heads_wanted()) {
    const auto flat = [&](const at::Tensor& x, int64_t t) { return split(x, t).reshape({b * heads, t, d}); };
    auto out = wide_head_attention(flat(q, tq), flat(k, tk), flat(v, tk));
    return out.view({b, heads, tq, d}).transpose(1, 2).reshape({b, tq, c});
  }
  // On the CPU a large attention (a 2048² image's 16k tokens: seconds) runs in query chunks, each
  // the same arithmetic for its rows, with a cancel point between them (cancel_point.h).
  constexpr int64_t kCpuChunkScores = int64_t(1) << 26;
  if (!q.is_cuda() && !causal && tq * tk > kCpuChunkScores && !at::GradMode::is_enabled()) {
    const auto keys = split(k, tk), values = split(v, tk), queries = split(q, tq);
    const int64_t rows = std::max<int64_t>(1, kCpuChunkScores / tk);
    std::vector<at::Tensor> parts;
    for (int64_t r = 0; r < tq; r += rows) {
      cancel_point();
      parts.push_back(at::scaled_dot_product_attention(queries.narrow(2, r, std::min(rows, tq - r)), keys, values));
    }
    return at::cat(parts, 2).transpose(1, 2).reshape({b, tq, c});
  }
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

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& context) {
  return attend(x, context, 0, x.dim() == 4 ? x.size(2) : 0);
}

at::Tensor AttentionImpl::forward_rows(const at::Tensor& x, int64_t row_begin, int64_t row_end) {
  // x: [B, C, H, W] -> [B, C, row_end - row_begin, W].
  if (x.dim() != 4 || options.cross_attention_dim > 0)
    throw Error("Attention.forward_rows: spatial self-attention only (x [B, C, H, W]), got x " + c10::str(x.sizes()) +
                (options.cross_attention_dim > 0 ? " in a cross-attention" : ""));
  if (row_begin < 0 || row_end <= row_begin || row_end > x.size(2))
    throw Error("Attention.forward_rows: rows [" + std::to_string(row_begin) + ", " + std::to_string(row_end) +
                ") of an input " + std::to_string(x.size(2)) + " rows high");
  return attend(x, {}, row_begin, row_end);
}

at::Tensor AttentionImpl::attend(const at::Tensor& x, const at::Tensor& context, int64_t row_begin, int64_t row_end) {
  const bool spatial = x.dim() == 4;
  at::Tensor h = x;
  int64_t b = x.size(0), c = 0, height = 0, width = 0;
  if (spatial) {
    c = x.size(1), height = x.size(2), width = x.size(3);
    h = x.view({b, c, height * width}).transpose(1, 2);
  }
  if (group_norm) h = group_norm->forward(h.transpose(1, 2)).transpose(1, 2);
  at::Tensor q, k, v;
  if (context.defined()) std::tie(k, v) = CrossKVScope::lookup(this, context);
  if (k.defined()) {
    q = to_q->forward(h);
  } else if (!context.defined() && !at::GradMode::is_enabled() && qkv_fused()) {
    const auto qkv = qkv_->project(h);
    q = qkv_->part(qkv, this, 0), k = qkv_->part(qkv, this, 1), v = qkv_->part(qkv, this, 2);
  } else {
    const at::Tensor& kv = context.defined() ? context : h;
    q = to_q->forward(h), k = to_k->forward(kv), v = to_v->forward(kv);
  }
  // Patch parallelism: this band's queries against the whole image's keys and values.
  if (!context.defined())
    if (auto* patch = patch_context()) std::tie(k, v) = patch->self_attention_kv(k, v);
  const int64_t rows = spatial ? row_end - row_begin : 0;
  if (spatial && rows != height) q = q.narrow(1, row_begin * width, rows * width);
  auto out = multi_head_attention(q, k, v, options.heads);
  out = to_out[0]->as<Linear>()->forward(out);
  if (spatial) out = out.transpose(1, 2).reshape({b, c, rows, width});
  if (options.residual_connection) out = out + (rows != height ? x.narrow(2, row_begin, rows) : x);
  if (options.rescale_output_factor != 1.0) out = out / options.rescale_output_factor;
  return out;
}

bool AttentionImpl::fuse_qkv() {
  if (options.cross_attention_dim > 0) return false;
  qkv_ = FusedLinears::fuse({{this, {to_q.get(), to_k.get(), to_v.get()}}});
  return qkv_ != nullptr;
}

bool AttentionImpl::qkv_fused() const { return qkv_ && qkv_->intact(); }

int fuse_attention_qkv(torch::nn::Module& root) {
  int fused = 0;
  for (const auto& m : root.modules(/*include_self=*/true))
    if (auto* a = dynamic_cast<AttentionImpl*>(m.get())) fused += a->fuse_qkv() ? 1 : 0;
  return fused;
}

bool fused_qkv_wanted() {
  return options::flag(options::Id::FusedQkv);
}

std::shared_ptr<CrossKV> CrossKV::fuse(torch::nn::Module& root) {
  return holding<CrossKV>(FusedLinears::fuse_below(root, [](torch::nn::Module& m) -> std::optional<FusedLinears::Member> {
    auto* a = dynamic_cast<AttentionImpl*>(&m);
    if (!a || a->options.cross_attention_dim <= 0) return std::nullopt;
    return FusedLinears::Member{a, {a->to_k.get(), a->to_v.get()}};
  }));
}

bool fused_cross_kv_wanted() {
  return options::flag(options::Id::FusedCrossKv);
}

namespace {
// DIFFRACT_GEGLU_ONE_GEMM=0: the two half-width GEMMs on CUDA too.
bool geglu_one_gemm() {
  static const bool on = [] {
    return options::flag(options::Id::GegluOneGemm);
  }();
  return on;
}

// GEGLU's projection; a module of its own so the key reads net.0.proj.
class GEGLUImpl : public nn::Module {
 public:
  GEGLUImpl(int64_t dim, int64_t inner) { proj = register_module("proj", Linear(dim, inner * 2)); }
  // Where geglu's kernel takes the projection's output, one GEMM and the kernel reading both
  // halves in place: one wide GEMM fills the GPU better than two half as wide (a batch-1 SDXL
  // step at 1024 tokens has too few tiles for 132 SMs). Elsewhere two GEMMs over the halves of
  // the weight, so that each half comes out contiguous for ATen's vectorised ops (on strided
  // halves gelu and the product run non-vectorised, measurably slower, docs/benchmarks.md).
  at::Tensor forward(const at::Tensor& x) {
    const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || proj->weight.requires_grad());
    const int64_t inner = proj->weight.size(0) / 2;
    auto y = fp8_linear(x, proj->fp8.get(), proj->weight, proj->bias);
    if (y.defined() || (x.is_cuda() && geglu_one_gemm() && fused_geglu_available() && !grad)) {
      if (!y.defined()) y = linear(x, proj->weight, proj->bias);
      // An fp8 net.2 reads the gate's e4m3 rows, written by the kernel that writes the gate.
      if (auto h = activation_with_fp8_rows(y, Fp8RowsActivation::GegluHalves); h.defined()) return h;
      return x.is_cuda() && fused_geglu_available() ? geglu_halves(y)
                                                    : geglu(y.narrow(-1, 0, inner).contiguous(), y.narrow(-1, inner, inner).contiguous());
    }
    const auto half = [&](int64_t i) {
      return linear(x, proj->weight.narrow(0, i * inner, inner),
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
  at::Tensor forward(const at::Tensor& x) {
    // An fp8 GEMM has no GELU epilogue here; elsewhere the GELU may run in the GEMM's (layers.h).
    if (proj->fp8) {
      const auto y = fp8_linear(x, proj->fp8.get(), proj->weight, proj->bias);
      if (y.defined()) {
        if (auto h = activation_with_fp8_rows(y, Fp8RowsActivation::GeluTanh); h.defined()) return h;
        return at::gelu(y, "tanh");
      }
    }
    return linear_gelu_tanh(x, proj->weight, proj->bias);
  }
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

at::Tensor FeedForwardImpl::forward(const at::Tensor& x) {
  const auto h = activation == FeedForwardActivation::GEGLU ? net[0]->as<GEGLU>()->forward(x)
                                                            : net[0]->as<GELUProj>()->forward(x);
  return net[2]->as<Linear>()->forward(h);
}

}  // namespace diffract::models
