#include "core/models/common/attention.h"

#include <ATen/ATen.h>

#include "core/util/error.h"

namespace diffract::models {

at::Tensor multi_head_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads,
                                bool causal) {
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

}  // namespace diffract::models
