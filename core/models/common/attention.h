#pragma once
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "core/models/common/fused_linears.h"
#include "core/models/common/layers.h"

namespace diffract::models {

// Scaled dot-product attention over packed heads.
// q: [B, Tq, H*D], k, v: [B, Tk, H*D] -> [B, Tq, H*D]. Uses the fused (flash / memory-
// efficient) kernels where the device has them.
at::Tensor multi_head_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads,
                                bool causal = false);

// Attention over heads wider than the fused kernels take, what multi_head_attention() runs on
// CUDA in inference for heads over 256 wide (DIFFRACT_WIDE_HEAD_ATTENTION=0: SDPA's memory-efficient
// kernel instead): q [N, Tq, d], k, v [N, Tk, d] -> [N, Tq, d], per chunk of queries the scores
// in fp32 from one GEMM, softmax in fp32, the probabilities in v's dtype times v. A chunk's
// scores take at most max_score_bytes (at least one query row).
at::Tensor wide_head_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               int64_t max_score_bytes = int64_t(256) << 20);

enum class Activation { QuickGELU, GELU, GELUTanh, SiLU };

// Names as transformers / diffusers configs spell them ("quick_gelu", "gelu", "gelu_new",
// "gelu_pytorch_tanh", "silu"); anything else is an error naming `where`.
Activation parse_activation(const std::string& name, const std::string& where);
at::Tensor apply_activation(Activation act, const at::Tensor& x);

// diffusers' Attention (self or cross), as UNet transformer blocks and the VAE mid-block
// use it: keys to_q, to_k, to_v, to_out.0 and, for the VAE, group_norm.
struct AttentionOptions {
  int64_t query_dim = 0;
  int64_t cross_attention_dim = 0;  // 0: self-attention
  int64_t heads = 8;
  int64_t dim_head = 64;
  bool bias = false;                // on to_q / to_k / to_v
  int64_t norm_num_groups = 0;      // > 0: GroupNorm over channels first (VAE)
  double norm_eps = 1e-5;
  bool residual_connection = false;
  double rescale_output_factor = 1.0;
};

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const AttentionOptions& o);
  // x: [B, T, C] or [B, C, H, W]; context: [B, S, Cc] or undefined (self-attention).
  // Returns the same shape as x.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context = {});
  // Spatial self-attention for some rows of the image: x [B, C, H, W] -> forward(x)'s rows
  // [row_begin, row_end), [B, C, row_end - row_begin, W]: those rows' queries against every
  // pixel's keys and values (a row-band VAE decode, core/parallel/parallel_vae.h).
  at::Tensor forward_rows(const at::Tensor& x, int64_t row_begin, int64_t row_end);

  // Self-attention only: lays to_q, to_k and to_v's weights (and biases) end to end in one
  // tensor, each parameter becoming a view of its rows, so inference projects q, k and v in one
  // GEMM of 3x the width. Keys, values and gradients of the parameters are unchanged; training
  // (autograd recording) still runs the three GEMMs. Moving the module (`to()`) gives the
  // parameters their own storage again: the fused path then stands down (qkv_fused() false)
  // until fuse_qkv() runs again. Returns whether it fused (not for cross-attention).
  bool fuse_qkv();
  bool qkv_fused() const;

  AttentionOptions options;
  GroupNorm group_norm{nullptr};
  Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  torch::nn::ModuleList to_out{nullptr};

 private:
  // forward(x, context), keeping only the queries of rows [row_begin, row_end) when x is spatial.
  at::Tensor attend(const at::Tensor& x, const at::Tensor& context, int64_t row_begin, int64_t row_end);
  std::shared_ptr<FusedLinears> qkv_;  // to_q, to_k, to_v when fused
};
TORCH_MODULE(Attention);

// fuse_qkv() on every self-attention below `root`; returns how many fused. The pipelines do it
// unless DIFFRACT_FUSED_QKV=0 (fused_qkv_wanted()): SDXL's step measured faster at batch 1 and
// 2 (docs/benchmarks.md).
int fuse_attention_qkv(torch::nn::Module& root);
bool fused_qkv_wanted();

// The keys and values of every cross-attention below a model (the UNets' attn2: 140 projections
// of the same text context in SDXL's step) from one GEMM instead of one small GEMM each.
// fuse() lays their to_k and to_v weights (and biases) end to end in one tensor, each parameter
// becoming a view of its rows, as fuse_qkv() does; state dicts, keys and gradients are unchanged.
// A forward that owns a CrossKV opens a CrossKVScope with its context; the attentions under it
// that are handed that same context tensor take their keys and values from the scope's product.
// Inference only (autograd recording runs the per-layer GEMMs), and only while every parameter
// is still a view (a move to another device or dtype gives them their own storage).
class CrossKV : public FusedLinearsGroup {
 public:
  // Null where `root` has no cross-attention. Members: the cross-attentions with the first one's
  // context width and bias setting (any other keeps its own GEMMs); per attention to_k, to_v.
  static std::shared_ptr<CrossKV> fuse(torch::nn::Module& root);
};

class CrossKVScope : FusedLinearsScope<CrossKV> {
 public:
  // context [B, S, Cc]. Projects every member's keys and values when `group` is non-null and
  // intact, context is defined and autograd is not recording; otherwise a scope that gives none.
  CrossKVScope(const CrossKV* group, const at::Tensor& context)
      : FusedLinearsScope(group ? group->linears() : nullptr, context) {}
  // The innermost scope's keys and values [B, S, inner] for `attention` given `context`, or
  // undefined tensors when there is none (no scope, not a member, another context tensor).
  static std::pair<at::Tensor, at::Tensor> lookup(const AttentionImpl* attention, const at::Tensor& context) {
    return {FusedLinearsScope::lookup(attention, context, 0), FusedLinearsScope::lookup(attention, context, 1)};
  }
};
bool fused_cross_kv_wanted();  // unless DIFFRACT_FUSED_CROSS_KV=0

// diffusers' FeedForward: net.0.proj, then net.2 (inner -> dim). With GEGLU (the UNets'
// "geglu") net.0.proj maps dim -> 2*inner and gates; with GELUTanh (SD3's "gelu-approximate")
// it maps dim -> inner followed by tanh-approximated GELU.
enum class FeedForwardActivation { GEGLU, GELUTanh };

class FeedForwardImpl : public torch::nn::Module {
 public:
  FeedForwardImpl(int64_t dim, int64_t inner_dim, FeedForwardActivation activation = FeedForwardActivation::GEGLU);
  // [B, T, dim] -> [B, T, dim]
  at::Tensor forward(const at::Tensor& x);
  FeedForwardActivation activation;
  torch::nn::ModuleList net{nullptr};
};
TORCH_MODULE(FeedForward);

}  // namespace diffract::models
