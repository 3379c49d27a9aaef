#include "core/models/transformers/sd3_transformer_2d.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <torch/nn/modules/dropout.h>

#include "core/io/diffusers_folder.h"
#include "core/io/json_file.h"
#include "core/io/weights.h"
#include "core/models/common/cancel_point.h"
#include "core/models/common/layer_norm.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/square_side.h"

namespace diffract::models {

namespace nn = torch::nn;

namespace {

constexpr double kEps = 1e-6;  // every norm of the model

// diffusers' get_2d_sincos_pos_embed(dim, grid, base_size): per token (row i, column j) the 1-D
// sincos embedding of the column coordinate, then of the row coordinate, coordinates scaled by
// base_size / grid. Float64 like diffusers, returned as float32 [1, grid*grid, dim].
at::Tensor sincos_grid(int64_t dim, int64_t grid, int64_t base_size) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto coords = at::arange(grid, f32) / (static_cast<double>(grid) / static_cast<double>(base_size));
  const int64_t quarter = dim / 4;
  auto omega = at::arange(quarter, at::TensorOptions().dtype(at::kDouble)) / (dim / 4.0);
  omega = 1.0 / at::pow(10000.0, omega);
  const auto one_d = [&](const at::Tensor& pos) {  // [M] -> [M, dim / 2]
    const auto out = at::outer(pos.to(at::kDouble), omega);
    return at::cat({at::sin(out), at::cos(out)}, 1);
  };
  const auto cols = coords.unsqueeze(0).expand({grid, grid}).reshape({-1});  // j of token i*grid + j
  const auto rows = coords.unsqueeze(1).expand({grid, grid}).reshape({-1});  // i
  return at::cat({one_d(cols), one_d(rows)}, 1).to(at::kFloat).unsqueeze(0);
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

// --- config ------------------------------------------------------------------------------------

bool SD3Transformer2DConfig::dual_attention(int64_t layer) const {
  return std::find(dual_attention_layers.begin(), dual_attention_layers.end(), layer) != dual_attention_layers.end();
}

SD3Transformer2DConfig SD3Transformer2DConfig::sd3_medium() {
  SD3Transformer2DConfig c;
  c.num_layers = 24;
  c.num_attention_heads = 24;
  c.caption_projection_dim = 1536;
  c.pos_embed_max_size = 192;
  return c;
}

SD3Transformer2DConfig SD3Transformer2DConfig::sd35_medium() {
  auto c = sd3_medium();
  c.pos_embed_max_size = 384;
  c.qk_norm = "rms_norm";
  for (int64_t i = 0; i <= 12; ++i) c.dual_attention_layers.push_back(i);
  return c;
}

SD3Transformer2DConfig SD3Transformer2DConfig::sd35_large() {
  SD3Transformer2DConfig c;
  c.num_layers = 38;
  c.num_attention_heads = 38;
  c.caption_projection_dim = 2432;
  c.pos_embed_max_size = 192;
  c.qk_norm = "rms_norm";
  return c;
}

void SD3Transformer2DConfig::validate(const std::string& where) const {
  const auto fail = [&](const std::string& what) { throw Error(where + ": " + what); };
  for (auto [name, v] : {std::pair<const char*, int64_t>{"sample_size", sample_size},
                         {"patch_size", patch_size},
                         {"in_channels", in_channels},
                         {"num_layers", num_layers},
                         {"attention_head_dim", attention_head_dim},
                         {"num_attention_heads", num_attention_heads},
                         {"joint_attention_dim", joint_attention_dim},
                         {"caption_projection_dim", caption_projection_dim},
                         {"pooled_projection_dim", pooled_projection_dim},
                         {"out_channels", out_channels},
                         {"pos_embed_max_size", pos_embed_max_size}})
    if (v <= 0) fail(std::string(name) + " must be positive, got " + std::to_string(v));
  if (caption_projection_dim != inner_dim())
    fail("caption_projection_dim " + std::to_string(caption_projection_dim) +
         " must equal num_attention_heads * attention_head_dim (" + std::to_string(inner_dim()) +
         "): the blocks' text stream has the image stream's width");
  if (inner_dim() % 4 != 0)
    fail("num_attention_heads * attention_head_dim (" + std::to_string(inner_dim()) +
         ") must be divisible by 4 for the 2-D sincos position embedding");
  for (int64_t l : dual_attention_layers)
    if (l < 0 || l >= num_layers)
      fail("dual_attention_layers holds " + std::to_string(l) + ", outside 0.." + std::to_string(num_layers - 1));
  if (!qk_norm.empty() && qk_norm != "rms_norm") fail("qk_norm '" + qk_norm + "' is not supported (null or rms_norm)");
}

SD3Transformer2DConfig SD3Transformer2DConfig::from_json(const std::filesystem::path& path) {
  const auto j = io::JsonFile::read(path);
  const std::string where = path.string();
  SD3Transformer2DConfig c;
  c.sample_size = j.optional<int64_t>("sample_size", c.sample_size);
  c.patch_size = j.optional<int64_t>("patch_size", c.patch_size);
  c.in_channels = j.optional<int64_t>("in_channels", c.in_channels);
  c.num_layers = j.optional<int64_t>("num_layers", c.num_layers);
  c.attention_head_dim = j.optional<int64_t>("attention_head_dim", c.attention_head_dim);
  c.num_attention_heads = j.optional<int64_t>("num_attention_heads", c.num_attention_heads);
  c.joint_attention_dim = j.optional<int64_t>("joint_attention_dim", c.joint_attention_dim);
  c.caption_projection_dim = j.optional<int64_t>("caption_projection_dim", c.caption_projection_dim);
  c.pooled_projection_dim = j.optional<int64_t>("pooled_projection_dim", c.pooled_projection_dim);
  c.out_channels = j.optional<int64_t>("out_channels", c.in_channels);  // null: in_channels, as diffusers
  if (j.json().contains("pos_embed_max_size") && j.json()["pos_embed_max_size"].is_null())
    throw Error(where + ": 'pos_embed_max_size' = null is not supported (SD3 crops a stored position grid)");
  c.pos_embed_max_size = j.optional<int64_t>("pos_embed_max_size", c.pos_embed_max_size);
  c.dual_attention_layers = j.optional<std::vector<int64_t>>("dual_attention_layers", {});
  c.qk_norm = j.optional<std::string>("qk_norm", "");
  if (!c.qk_norm.empty() && c.qk_norm != "rms_norm")
    throw Error(where + ": 'qk_norm' = \"" + c.qk_norm + "\" is not supported (null or \"rms_norm\", as SD3 / SD3.5)");
  c.validate(where);
  return c;
}

SD3Transformer2DConfig SD3Transformer2DConfig::from_shapes(const std::vector<io::TensorShape>& tensors,
                                                           const std::string& what, int64_t head_dim) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& t : tensors) shapes.emplace(t.name, t.shape);
  const auto need = [&](const std::string& key, size_t rank) -> const std::vector<int64_t>& {
    auto it = shapes.find(key);
    if (it == shapes.end())
      throw Error(what + ": no tensor '" + key + "', so this is no diffusers SD3Transformer2DModel");
    if (it->second.size() != rank)
      throw Error(what + ": '" + key + "' has shape " + shape_str(it->second) + ", expected " + std::to_string(rank) +
                  " dimensions");
    return it->second;
  };
  SD3Transformer2DConfig c;
  const auto& proj = need("pos_embed.proj.weight", 4);  // [D, Cin, p, p]
  const int64_t dim = proj[0];
  c.in_channels = proj[1];
  c.patch_size = proj[2];
  if (c.patch_size <= 0 || proj[3] != c.patch_size)
    throw Error(what + ": 'pos_embed.proj.weight' has shape " + shape_str(proj) +
                ", expected a square patch of at least 1 in its last two dimensions");
  const auto& grid = need("pos_embed.pos_embed", 3);  // [1, G*G, D]
  const auto side = square_side(grid[1]);
  if (!side)
    throw Error(what + ": 'pos_embed.pos_embed' has " + std::to_string(grid[1]) + " positions, not a square grid");
  c.pos_embed_max_size = *side;
  const auto& context = need("context_embedder.weight", 2);
  c.caption_projection_dim = context[0];
  c.joint_attention_dim = context[1];
  c.pooled_projection_dim = need("time_text_embed.text_embedder.linear_1.weight", 2)[1];
  const auto& out = need("proj_out.weight", 2);  // [p * p * Cout, D]
  if (out[0] <= 0 || out[0] % c.patch_size != 0 || out[0] / c.patch_size % c.patch_size != 0)
    throw Error(what + ": 'proj_out.weight' has shape " + shape_str(out) + ", expected [" +
                std::to_string(c.patch_size) + " * " + std::to_string(c.patch_size) + " * out_channels, width]");
  c.out_channels = out[0] / c.patch_size / c.patch_size;
  std::set<int64_t> layers, dual;
  const std::string prefix = "transformer_blocks.";
  for (const auto& [name, shape] : shapes) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const auto dot = name.find('.', prefix.size());
    const auto digits = name.substr(prefix.size(), dot == std::string::npos ? std::string::npos : dot - prefix.size());
    if (dot == std::string::npos || digits.empty() ||
        !std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
      throw Error(what + ": unexpected tensor '" + name + "' (expected transformer_blocks.N.*)");
    const int64_t index = std::stoll(digits);
    layers.insert(index);
    if (name.compare(dot, 7, ".attn2.") == 0) dual.insert(index);
  }
  c.num_layers = static_cast<int64_t>(layers.size());
  if (c.num_layers == 0 || *layers.rbegin() != c.num_layers - 1)
    throw Error(what + ": transformer_blocks are missing or not numbered 0..N-1");
  c.dual_attention_layers.assign(dual.begin(), dual.end());
  if (shapes.count("transformer_blocks.0.attn.norm_q.weight")) {
    c.qk_norm = "rms_norm";
    c.attention_head_dim = need("transformer_blocks.0.attn.norm_q.weight", 1)[0];
  } else {
    c.attention_head_dim = head_dim;  // not visible in the weights without qk norm
  }
  if (c.attention_head_dim <= 0 || dim % c.attention_head_dim != 0)
    throw Error(what + ": width " + std::to_string(dim) + " is not a multiple of the head width " +
                std::to_string(c.attention_head_dim) +
                (c.qk_norm.empty() ? " (assumed: no qk-norm weights show it)" : ""));
  c.num_attention_heads = dim / c.attention_head_dim;
  c.validate(what);
  return c;
}

// --- blocks ------------------------------------------------------------------------------------

JointAttentionImpl::JointAttentionImpl(const JointAttentionOptions& o) : options(o) {
  const int64_t inner = o.heads * o.head_dim;
  to_q = register_module("to_q", Linear(o.dim, inner));
  to_k = register_module("to_k", Linear(o.dim, inner));
  to_v = register_module("to_v", Linear(o.dim, inner));
  if (o.qk_norm) {
    norm_q = register_module("norm_q", RMSNorm(o.head_dim, kEps));
    norm_k = register_module("norm_k", RMSNorm(o.head_dim, kEps));
  }
  if (o.joint) {
    add_k_proj = register_module("add_k_proj", Linear(o.dim, inner));
    add_v_proj = register_module("add_v_proj", Linear(o.dim, inner));
    add_q_proj = register_module("add_q_proj", Linear(o.dim, inner));
  }
  to_out = register_module("to_out", nn::ModuleList(Linear(inner, o.dim), nn::Dropout(0.0)));
  if (o.joint && !o.context_pre_only) to_add_out = register_module("to_add_out", Linear(inner, o.dim));
  if (o.joint && o.qk_norm) {
    norm_added_q = register_module("norm_added_q", RMSNorm(o.head_dim, kEps));
    norm_added_k = register_module("norm_added_k", RMSNorm(o.head_dim, kEps));
  }
}

std::pair<at::Tensor, at::Tensor> JointAttentionImpl::forward(const at::Tensor& x, const at::Tensor& context,
                                                              ImageKV* cache, int64_t begin, const SequenceShard* shard) {
  // x [B, N, D], context [B, S, D] (joint) -> {[B, N, D], [B, S, D] (joint) or undefined}
  const int64_t b = x.size(0), n = x.size(1), h = options.heads, d = options.head_dim;
  // Per-head RMS norm on packed [B, T, H*D] projections.
  const auto per_head = [&](RMSNorm& norm, const at::Tensor& t) {
    if (!norm) return t;
    return norm->forward(t.view({b, t.size(1), h, d})).view({b, t.size(1), h * d});
  };
  const bool joint = options.joint && context.defined();
  TORCH_CHECK(joint == options.joint, "joint attention needs the text tokens");
  const int64_t s = joint ? context.size(1) : 0;
  // q, k, v [B, N + S, H*D]: the image tokens, then the text's; the text first under Ulysses,
  // which takes it so (without a mask or positions the order of the keys does not change what
  // each query gets).
  const bool text_first = shard != nullptr;
  at::Tensor q, k, v;
  if (joint && !cache && !options.qk_norm && qkv_ && qkv_->intact() && added_qkv_ && added_qkv_->intact()) {
    // Both streams' GEMMs joined once, then sliced: joining the slices instead (q with the text's
    // q, and so on) is ATen's cat of strided inputs, and SD3-medium's step measured 2.6 ms slower
    // that way than with the projections apart (1024², H100).
    // With DIFFRACT_GEMM_STRIDED_BATCH each stream's GEMM writes its rows of the joint sequence
    // (a strided-batch GEMM at batch 2), and no cat joins them.
    at::Tensor all;
    if (gemm_strided_batch_enabled()) {
      all = at::empty({b, n + s, qkv_->out_features()}, x.options());
      auto image_rows = all.slice(1, text_first ? s : 0, text_first ? s + n : n);
      auto text_rows = all.slice(1, text_first ? 0 : n, text_first ? s : n + s);
      qkv_->project_into(image_rows, x);
      added_qkv_->project_into(text_rows, context);
    } else {
      const auto image = qkv_->project(x), text = added_qkv_->project(context);
      all = text_first ? at::cat({text, image}, 1) : at::cat({image, text}, 1);
    }
    q = qkv_->part(all, this, 0);
    k = qkv_->part(all, this, 1);
    v = qkv_->part(all, this, 2);
  } else {
    auto [image_q, image_k, image_v] = project_qkv(qkv_.get(), this, *to_q, *to_k, *to_v, x);
    q = per_head(norm_q, image_q);
    k = per_head(norm_k, image_k);
    v = image_v;
    if (cache) cache->write(k, v, begin);
    if (joint) {
      const auto [text_q, text_k, text_v] =
          project_qkv(added_qkv_.get(), this, *add_q_proj, *add_k_proj, *add_v_proj, context);
      const auto join = [&](const at::Tensor& image, const at::Tensor& text) {
        return text_first ? at::cat({text, image}, 1) : at::cat({image, text}, 1);
      };
      q = join(q, per_head(norm_added_q, text_q));
      k = join(k, per_head(norm_added_k, text_k));
      v = join(v, text_v);
    }
  }
  if (shard) {
    TORCH_CHECK(!cache, "SD3 attention: sequence parallelism with an image K/V cache");
    auto mine = *shard;
    mine.text_tokens = s;
    const auto rows = [&](const at::Tensor& t) { return t.view({b, s + n, h, d}); };
    const auto out = ulysses_attention(rows(q), rows(k), rows(v), mine);
    auto image = to_out[0]->as<Linear>()->forward(out.slice(1, s));
    at::Tensor text_out;
    if (joint) {
      text_out = out.slice(1, 0, s);
      if (to_add_out) text_out = to_add_out->forward(text_out);
    }
    return {image, text_out};
  }
  const auto out = multi_head_attention(q, k, v, h);
  auto image = to_out[0]->as<Linear>()->forward(out.slice(1, 0, n));
  at::Tensor text;
  if (joint) {
    text = out.slice(1, n);
    if (to_add_out) text = to_add_out->forward(text);
  }
  return {image, text};
}

void JointAttentionImpl::fuse_projections() {
  qkv_ = FusedLinears::fuse({{this, {to_q.get(), to_k.get(), to_v.get()}}});
  if (options.joint) added_qkv_ = FusedLinears::fuse({{this, {add_q_proj.get(), add_k_proj.get(), add_v_proj.get()}}});
}

JointTransformerBlockImpl::JointTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim, bool pre_only,
                                                     bool qk_norm, bool dual)
    : context_pre_only(pre_only), dual_attention(dual) {
  norm1 = register_module("norm1", AdaLayerNormZero(dim, dual));
  if (pre_only) norm1_context_continuous = register_module("norm1_context", AdaLayerNormContinuous(dim, dim));
  else norm1_context_zero = register_module("norm1_context", AdaLayerNormZero(dim, false));
  JointAttentionOptions o;
  o.dim = dim;
  o.heads = heads;
  o.head_dim = head_dim;
  o.qk_norm = qk_norm;
  o.context_pre_only = pre_only;
  attn = register_module("attn", JointAttention(o));
  if (dual) {
    o.joint = false;
    attn2 = register_module("attn2", JointAttention(o));
  }
  ff = register_module("ff", FeedForward(dim, 4 * dim, FeedForwardActivation::GELUTanh));
  if (!pre_only) ff_context = register_module("ff_context", FeedForward(dim, 4 * dim, FeedForwardActivation::GELUTanh));
}

std::pair<at::Tensor, at::Tensor> JointTransformerBlockImpl::forward(const at::Tensor& x, const at::Tensor& context,
                                                                     const at::Tensor& temb, ImageKV* cache,
                                                                     ImageKV* cache2, int64_t begin,
                                                                     const SequenceShard* shard) {
  // x [B, N, D], context [B, S, D], temb [B, D] -> {context' [B, S, D] or undefined, x' [B, N, D]}
  cancel_point();
  const auto n = norm1->forward(x, temb);
  AdaNormZeroOut c;
  if (context_pre_only) c.x = norm1_context_continuous->forward(context, temb);
  else c = norm1_context_zero->forward(context, temb);

  auto [attn_out, context_attn_out] = attn->forward(n.x, c.x, cache, begin, shard);
  at::Tensor h = x;
  if (dual_attention) {
    h = gated_residual(h, n.gate_msa, attn_out);
    attn_out = attn2->forward(n.x2, {}, cache2, begin, shard).first;
  }
  const auto [h_attn, nh] =
      gated_residual_modulated_layer_norm(h, dual_attention ? n.gate_msa2 : n.gate_msa, attn_out, n.scale_mlp,
                                          n.shift_mlp, kEps);
  h = gated_residual(h_attn, n.gate_mlp, ff->forward(nh));
  if (context_pre_only) return {at::Tensor(), h};

  const auto [ctx_attn, nc] =
      gated_residual_modulated_layer_norm(context, c.gate_msa, context_attn_out, c.scale_mlp, c.shift_mlp, kEps);
  return {gated_residual(ctx_attn, c.gate_mlp, ff_context->forward(nc)), h};
}

SD3PatchEmbedImpl::SD3PatchEmbedImpl(const SD3Transformer2DConfig& c)
    : patch_size(c.patch_size), max_size(c.pos_embed_max_size) {
  const int64_t dim = c.inner_dim();
  proj = register_module(
      "proj", Conv2d(Conv2dOptions(c.in_channels, dim, c.patch_size).stride(c.patch_size)));
  pos_embed = register_buffer("pos_embed", sincos_grid(dim, max_size, c.sample_size / c.patch_size));
}

at::Tensor SD3PatchEmbedImpl::cropped_pos_embed(int64_t h, int64_t w) const {
  if (h > max_size || w > max_size)
    throw Error("SD3 transformer: a latent of " + std::to_string(h) + "x" + std::to_string(w) +
                " patches exceeds the position grid of " + std::to_string(max_size) + "x" + std::to_string(max_size) +
                " (pos_embed_max_size)");
  const int64_t top = (max_size - h) / 2, left = (max_size - w) / 2;
  return pos_embed.view({1, max_size, max_size, -1})
      .slice(1, top, top + h)
      .slice(2, left, left + w)
      .reshape({1, h * w, -1});
}

at::Tensor SD3PatchEmbedImpl::forward_rows(const at::Tensor& rows, int64_t row0, int64_t full_height) {
  // rows [B, C, h, W] -> [B, (h/p)*(W/p), D]
  const int64_t h = rows.size(-2) / patch_size, w = rows.size(-1) / patch_size;
  if (row0 % patch_size || rows.size(-2) % patch_size || full_height % patch_size || row0 + rows.size(-2) > full_height)
    throw Error("SD3 patch embedding: latent rows " + std::to_string(row0) + "+" + std::to_string(rows.size(-2)) +
                " of " + std::to_string(full_height) + " do not fall on whole patches of " + std::to_string(patch_size));
  const auto pos = cropped_pos_embed(full_height / patch_size, w).reshape({1, full_height / patch_size, w, -1});
  const auto x = proj->forward(rows).flatten(2).transpose(1, 2);
  return (x + pos.narrow(1, row0 / patch_size, h).reshape({1, h * w, -1})).to(x.scalar_type());
}

at::Tensor SD3PatchEmbedImpl::forward(const at::Tensor& latent) {
  // [B, C, H, W] -> [B, (H/p)*(W/p), D], tokens row by row
  const int64_t h = latent.size(-2) / patch_size, w = latent.size(-1) / patch_size;
  const auto x = proj->forward(latent).flatten(2).transpose(1, 2);
  return (x + cropped_pos_embed(h, w)).to(x.scalar_type());
}

CombinedTimestepTextProjEmbeddingsImpl::CombinedTimestepTextProjEmbeddingsImpl(int64_t dim, int64_t pooled_dim) {
  timestep_embedder = register_module("timestep_embedder", TimestepEmbedding(256, dim));
  text_embedder = register_module("text_embedder", TimestepEmbedding(pooled_dim, dim));
}

at::Tensor CombinedTimestepTextProjEmbeddingsImpl::forward(const at::Tensor& timestep, const at::Tensor& pooled) {
  // timestep [B] (float), pooled [B, P] -> [B, D]
  const auto t = timestep_embedding(timestep, 256, /*flip_sin_to_cos=*/true, /*downscale_freq_shift=*/0);
  return timestep_embedder->forward(t.to(pooled.scalar_type())) + text_embedder->forward(pooled);
}

// --- model -------------------------------------------------------------------------------------

SD3Transformer2DModelImpl::SD3Transformer2DModelImpl(const SD3Transformer2DConfig& c) : config(c) {
  c.validate("SD3 transformer config");
  const int64_t dim = c.inner_dim();
  pos_embed = register_module("pos_embed", SD3PatchEmbed(c));
  time_text_embed =
      register_module("time_text_embed", CombinedTimestepTextProjEmbeddings(dim, c.pooled_projection_dim));
  context_embedder = register_module("context_embedder", Linear(c.joint_attention_dim, c.caption_projection_dim));
  transformer_blocks = register_module("transformer_blocks", nn::ModuleList());
  for (int64_t i = 0; i < c.num_layers; ++i)
    transformer_blocks->push_back(JointTransformerBlock(dim, c.num_attention_heads, c.attention_head_dim,
                                                        i == c.num_layers - 1, !c.qk_norm.empty(),
                                                        c.dual_attention(i)));
  norm_out = register_module("norm_out", AdaLayerNormContinuous(dim, dim));
  proj_out = register_module("proj_out", Linear(dim, c.patch_size * c.patch_size * c.out_channels));
}

SD3State SD3Transformer2DModelImpl::embed(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                                          const at::Tensor& pooled_projections, const at::Tensor& timestep) {
  const auto p = config.patch_size;
  TORCH_CHECK(hidden_states.dim() == 4 && hidden_states.size(1) == config.in_channels,
              "SD3 transformer: latents must be [B, ", config.in_channels, ", H, W], got ", hidden_states.sizes());
  if (hidden_states.size(2) % p != 0 || hidden_states.size(3) % p != 0)
    throw Error("SD3 transformer: latent size " + std::to_string(hidden_states.size(2)) + "x" +
                std::to_string(hidden_states.size(3)) + " is not a multiple of the patch size " + std::to_string(p));
  SD3State s;
  s.height = hidden_states.size(2);
  s.width = hidden_states.size(3);
  const auto t = timestep.dim() == 0 ? timestep.expand({hidden_states.size(0)}) : timestep;
  s.x = pos_embed->forward(hidden_states).contiguous();
  s.temb = time_text_embed->forward(t, pooled_projections);
  s.context = context_embedder->forward(encoder_hidden_states);
  return s;
}

void SD3Transformer2DModelImpl::run_block(size_t index, SD3State& s) {
  auto [context, x] = transformer_blocks[index]->as<JointTransformerBlock>()->forward(s.x, s.context, s.temb, nullptr,
                                                                                     nullptr, 0, s.shard);
  s.context = context;
  s.x = x;
}

void SD3Transformer2DModelImpl::run_block(size_t index, SD3State& s, SD3BlockCache& cache, int64_t begin) {
  auto [context, x] =
      transformer_blocks[index]->as<JointTransformerBlock>()->forward(s.x, s.context, s.temb, &cache.attn, &cache.attn2, begin);
  s.context = context;
  s.x = x;
}

at::Tensor SD3Transformer2DModelImpl::unpatchify_output(const SD3State& s) {
  const int64_t p = config.patch_size, c = config.out_channels, b = s.x.size(0);
  const int64_t h = s.height / p, w = s.width / p;
  const auto x = proj_out->forward(norm_out->forward(s.x, s.temb));
  // [B, h*w, p*p*C] -> [B, h, w, p, q, C] -> [B, C, h, p, w, q] (diffusers' einsum nhwpqc->nchpwq)
  return x.reshape({b, h, w, p, p, c}).permute({0, 5, 1, 3, 2, 4}).reshape({b, c, h * p, w * p});
}

void SD3Transformer2DModelImpl::fuse_projections() {
  for (const auto& b : *transformer_blocks) {
    auto& block = *b->as<JointTransformerBlock>();
    block.attn->fuse_projections();
    if (block.attn2) block.attn2->fuse_projections();
  }
}

at::Tensor SD3Transformer2DModelImpl::forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                                              const at::Tensor& pooled_projections, const at::Tensor& timestep,
                                              const SequenceShard* shard) {
  // hidden_states [B, Cin, H, W], encoder_hidden_states [B, S, joint_attention_dim],
  // pooled_projections [B, pooled_projection_dim], timestep [B] or [] -> [B, Cout, H, W]
  auto s = embed(hidden_states, encoder_hidden_states, pooled_projections, timestep);
  if (shard) {
    TORCH_CHECK(shard->image_total == s.x.size(1), "SD3 transformer: a sequence shard of ", shard->image_total,
                " image tokens for ", s.x.size(1));
    s.x = s.x.narrow(1, shard->image_begin, shard->image_tokens).contiguous();
    s.shard = shard;
  }
  for (size_t i = 0; i < transformer_blocks->size(); ++i) run_block(i, s);
  if (shard) {
    auto parts = shard->exchange->all_gather(s.x.contiguous());
    for (auto& p : parts) p = p.to(s.x.device());
    s.x = at::cat(parts, 1);
    s.shard = nullptr;
  }
  return unpatchify_output(s);
}

at::Tensor SD3Transformer2DModelImpl::forward_cached(const at::Tensor& hidden_states,
                                                     const at::Tensor& encoder_hidden_states,
                                                     const at::Tensor& pooled_projections, const at::Tensor& timestep,
                                                     FirstBlockCache& cache) {
  auto s = embed(hidden_states, encoder_hidden_states, pooled_projections, timestep);
  const auto before = s.x;
  run_block(0, s);
  const auto after_first = s.x;
  const auto first = after_first - before;
  cache.reused = cache.can_reuse(first);
  cache.reused_work = 1.0 / static_cast<double>(transformer_blocks->size());
  if (cache.reused) {
    s.x = after_first + cache.rest_residual;
    return unpatchify_output(s);
  }
  for (size_t i = 1; i < transformer_blocks->size(); ++i) run_block(i, s);
  cache.first_residual = first;
  cache.rest_residual = s.x - after_first;
  return unpatchify_output(s);
}

at::Tensor SD3Transformer2DModelImpl::forward_teacached(const at::Tensor& hidden_states,
                                                        const at::Tensor& encoder_hidden_states,
                                                        const at::Tensor& pooled_projections,
                                                        const at::Tensor& timestep, TeaCache& cache) {
  auto s = embed(hidden_states, encoder_hidden_states, pooled_projections, timestep);
  const auto modulated = transformer_blocks[0]->as<JointTransformerBlock>()->norm1->forward(s.x, s.temb).x;
  cache.reused = cache.can_reuse(modulated);
  cache.reused_work = 0;  // the embedding and one modulation
  if (cache.reused) {
    s.x = s.x + cache.residual;
    return unpatchify_output(s);
  }
  const auto before = s.x;
  for (size_t i = 0; i < transformer_blocks->size(); ++i) run_block(i, s);
  cache.residual = s.x - before;
  return unpatchify_output(s);
}

SD3Transformer2DModel load_sd3_transformer(const std::filesystem::path& dir, const std::string& variant) {
  const auto config = SD3Transformer2DConfig::from_json(dir / "config.json");
  const auto weights = io::require_weights(dir, variant);
  SD3Transformer2DModel model(config);
  model->eval();
  io::bind(*model, io::load_state_dict(weights), weights.string());
  log::get("models").debug(log::str(dir.string(), ": SD3 transformer with ", config.num_layers, " blocks, ",
                                    config.num_attention_heads, " heads"));
  return model;
}

}  // namespace diffract::models
