#include "core/models/transformers/flux_transformer_2d.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include <ATen/ATen.h>
#include <torch/nn/modules/dropout.h>

#include "core/io/diffusers_folder.h"
#include "core/io/json_file.h"
#include "core/io/weights.h"
#include "core/models/common/cancel_point.h"
#include "core/models/common/fp8_linear.h"
#include "core/models/common/geglu.h"
#include "core/models/common/layer_norm.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/options.h"

namespace diffract::models {

namespace nn = torch::nn;

namespace {

constexpr double kEps = 1e-6;  // every norm of the model

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The block indices under `prefix` ("transformer_blocks."): must be 0..N-1.
int64_t count_blocks(const std::map<std::string, std::vector<int64_t>>& shapes, const std::string& prefix,
                     const std::string& what) {
  std::set<int64_t> blocks;
  for (const auto& [name, shape] : shapes) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const auto dot = name.find('.', prefix.size());
    const auto digits = name.substr(prefix.size(), dot == std::string::npos ? std::string::npos : dot - prefix.size());
    if (dot == std::string::npos || digits.empty() || digits.size() > 6 ||
        !std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
      throw Error(what + ": unexpected tensor '" + name + "' (expected " + prefix + "N.*)");
    blocks.insert(std::stoll(digits));
  }
  if (!blocks.empty() && *blocks.rbegin() != static_cast<int64_t>(blocks.size()) - 1)
    throw Error(what + ": " + prefix + "* are not numbered 0..N-1");
  return static_cast<int64_t>(blocks.size());
}

}  // namespace

// --- config ------------------------------------------------------------------------------------

FluxTransformer2DConfig FluxTransformer2DConfig::dev() {
  FluxTransformer2DConfig c;
  c.guidance_embeds = true;
  return c;
}

FluxTransformer2DConfig FluxTransformer2DConfig::schnell() { return FluxTransformer2DConfig{}; }

void FluxTransformer2DConfig::validate(const std::string& where) const {
  const auto fail = [&](const std::string& what) { throw Error(where + ": " + what); };
  for (auto [name, v] : {std::pair<const char*, int64_t>{"patch_size", patch_size},
                         {"in_channels", in_channels},
                         {"out_channels", out_channels},
                         {"attention_head_dim", attention_head_dim},
                         {"num_attention_heads", num_attention_heads},
                         {"joint_attention_dim", joint_attention_dim},
                         {"pooled_projection_dim", pooled_projection_dim}})
    if (v <= 0) fail(std::string(name) + " must be positive, got " + std::to_string(v));
  for (auto [name, v] : {std::pair<const char*, int64_t>{"num_layers", num_layers},
                         {"num_single_layers", num_single_layers}})
    if (v < 0 || v > 1000) fail(std::string(name) + " must be 0..1000, got " + std::to_string(v));
  if (num_layers + num_single_layers == 0) fail("the model has no blocks (num_layers and num_single_layers are 0)");
  if (patch_size != 1)
    fail("patch_size " + std::to_string(patch_size) + " is not supported (Flux packs 2x2 latent patches itself: 1)");
  if (in_channels % 4 != 0)
    fail("in_channels " + std::to_string(in_channels) + " is not 4 x the latent channels (2x2 packed patches)");
  if (attention_head_dim % 2 != 0) fail("attention_head_dim " + std::to_string(attention_head_dim) + " must be even (rotary pairs)");
  if (axes_dims_rope.empty()) fail("axes_dims_rope is empty");
  for (auto d : axes_dims_rope)
    if (d <= 0 || d % 2 != 0) fail("axes_dims_rope holds " + std::to_string(d) + ": each must be positive and even");
  const int64_t sum = std::accumulate(axes_dims_rope.begin(), axes_dims_rope.end(), int64_t(0));
  if (sum != attention_head_dim)
    fail("axes_dims_rope sums to " + std::to_string(sum) + ", not attention_head_dim " +
         std::to_string(attention_head_dim) + " (the rope rotates every feature of a head)");
  if (inner_dim() > (int64_t(1) << 20)) fail("num_attention_heads * attention_head_dim is above 2^20");
}

FluxTransformer2DConfig FluxTransformer2DConfig::from_json(const std::filesystem::path& path) {
  const auto j = io::JsonFile::read(path);
  const std::string where = path.string();
  FluxTransformer2DConfig c;
  c.patch_size = j.optional<int64_t>("patch_size", c.patch_size);
  c.in_channels = j.optional<int64_t>("in_channels", c.in_channels);
  c.out_channels = j.optional<int64_t>("out_channels", c.in_channels);  // null: in_channels, as diffusers
  c.num_layers = j.optional<int64_t>("num_layers", c.num_layers);
  c.num_single_layers = j.optional<int64_t>("num_single_layers", c.num_single_layers);
  c.attention_head_dim = j.optional<int64_t>("attention_head_dim", c.attention_head_dim);
  c.num_attention_heads = j.optional<int64_t>("num_attention_heads", c.num_attention_heads);
  c.joint_attention_dim = j.optional<int64_t>("joint_attention_dim", c.joint_attention_dim);
  c.pooled_projection_dim = j.optional<int64_t>("pooled_projection_dim", c.pooled_projection_dim);
  c.guidance_embeds = j.optional<bool>("guidance_embeds", c.guidance_embeds);
  c.axes_dims_rope = j.optional<std::vector<int64_t>>("axes_dims_rope", c.axes_dims_rope);
  c.validate(where);
  return c;
}

FluxTransformer2DConfig FluxTransformer2DConfig::from_shapes(const std::vector<io::TensorShape>& tensors,
                                                             const std::string& what) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& t : tensors) shapes.emplace(t.name, t.shape);
  const auto need = [&](const std::string& key, size_t rank) -> const std::vector<int64_t>& {
    auto it = shapes.find(key);
    if (it == shapes.end()) throw Error(what + ": no tensor '" + key + "', so this is no Flux transformer");
    if (it->second.size() != rank)
      throw Error(what + ": '" + key + "' has shape " + shape_str(it->second) + ", expected " + std::to_string(rank) +
                  " dimensions");
    return it->second;
  };
  FluxTransformer2DConfig c;
  const auto& x = need("x_embedder.weight", 2);  // [D, Cin]
  const int64_t dim = x[0];
  c.in_channels = x[1];
  const auto& ctx = need("context_embedder.weight", 2);
  c.joint_attention_dim = ctx[1];
  c.pooled_projection_dim = need("time_text_embed.text_embedder.linear_1.weight", 2)[1];
  c.out_channels = need("proj_out.weight", 2)[0];
  c.guidance_embeds = shapes.count("time_text_embed.guidance_embedder.linear_1.weight") > 0;
  c.num_layers = count_blocks(shapes, "transformer_blocks.", what);
  c.num_single_layers = count_blocks(shapes, "single_transformer_blocks.", what);
  const std::string norm_q = c.num_layers > 0 ? "transformer_blocks.0.attn.norm_q.weight"
                                              : "single_transformer_blocks.0.attn.norm_q.weight";
  c.attention_head_dim = need(norm_q, 1)[0];
  if (c.attention_head_dim <= 0 || dim % c.attention_head_dim != 0)
    throw Error(what + ": width " + std::to_string(dim) + " is not a multiple of the head width " +
                std::to_string(c.attention_head_dim) + " ('" + norm_q + "')");
  c.num_attention_heads = dim / c.attention_head_dim;
  // The rope's split over (text, row, column) is not in the weights: Flux's 16 + 56 + 56 of 128,
  // the same proportions for other head widths.
  const int64_t spatial = c.attention_head_dim * 7 / 16 / 2 * 2;
  c.axes_dims_rope = {c.attention_head_dim - 2 * spatial, spatial, spatial};
  c.validate(what);
  return c;
}

// --- rope --------------------------------------------------------------------------------------

FluxRope flux_rope(const at::Tensor& ids, const std::vector<int64_t>& axes_dims, double theta) {
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) == static_cast<int64_t>(axes_dims.size()), "Flux rope: ids must be [S, ",
              axes_dims.size(), "], got ", ids.sizes());
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(ids.device());
  const auto pos = ids.to(at::kFloat).to(at::kDouble);
  std::vector<at::Tensor> cos, sin;
  for (size_t i = 0; i < axes_dims.size(); ++i) {
    const int64_t d = axes_dims[i];
    const auto freqs = 1.0 / at::pow(theta, at::arange(0, d, 2, f64) / static_cast<double>(d));
    const auto f = at::outer(pos.select(1, static_cast<int64_t>(i)), freqs);  // [S, d / 2]
    cos.push_back(f.cos().repeat_interleave(2, 1).to(at::kFloat));
    sin.push_back(f.sin().repeat_interleave(2, 1).to(at::kFloat));
  }
  return {at::cat(cos, -1), at::cat(sin, -1)};
}

// --- blocks ------------------------------------------------------------------------------------

FluxAttentionImpl::FluxAttentionImpl(const FluxAttentionOptions& o) : options(o) {
  const int64_t inner = o.heads * o.head_dim;
  norm_q = register_module("norm_q", RMSNorm(o.head_dim, kEps));
  norm_k = register_module("norm_k", RMSNorm(o.head_dim, kEps));
  to_q = register_module("to_q", Linear(o.dim, inner));
  to_k = register_module("to_k", Linear(o.dim, inner));
  to_v = register_module("to_v", Linear(o.dim, inner));
  if (!o.pre_only) to_out = register_module("to_out", nn::ModuleList(Linear(inner, o.dim), nn::Dropout(0.0)));
  if (o.joint) {
    norm_added_q = register_module("norm_added_q", RMSNorm(o.head_dim, kEps));
    norm_added_k = register_module("norm_added_k", RMSNorm(o.head_dim, kEps));
    add_q_proj = register_module("add_q_proj", Linear(o.dim, inner));
    add_k_proj = register_module("add_k_proj", Linear(o.dim, inner));
    add_v_proj = register_module("add_v_proj", Linear(o.dim, inner));
    to_add_out = register_module("to_add_out", Linear(inner, o.dim));
  }
}

std::pair<at::Tensor, at::Tensor> FluxAttentionImpl::forward(const at::Tensor& x, const at::Tensor& context,
                                                             const FluxRope& rope, const SequenceShard* shard,
                                                             const FluxPatch* patch) {
  const auto [q, k, v] = project_qkv(qkv_.get(), this, *to_q, *to_k, *to_v, x);
  return attend(q, k, v, context, rope, shard, patch);
}

std::pair<at::Tensor, at::Tensor> FluxAttentionImpl::attend(const at::Tensor& q_in, const at::Tensor& k_in,
                                                            const at::Tensor& v_in, const at::Tensor& context,
                                                            const FluxRope& rope, const SequenceShard* shard,
                                                            const FluxPatch* patch) {
  const int64_t b = q_in.size(0), h = options.heads, d = options.head_dim;
  const auto heads = [&](const at::Tensor& t) { return t.unflatten(-1, {h, d}); };
  const bool joint = options.joint;
  TORCH_CHECK(joint == context.defined(), "Flux attention: the double-stream blocks take the text tokens, the single-stream ones do not");
  const int64_t s0 = joint ? context.size(1) : 0;  // the text tokens come first
  auto q = at::empty({b, s0 + q_in.size(1), h, d}, q_in.options());
  auto k = at::empty_like(q);
  at::Tensor v;
  rms_norm_rope_into(*norm_q, heads(q_in), rope, q, s0);
  rms_norm_rope_into(*norm_k, heads(k_in), rope, k, s0);
  if (joint) {
    const auto [cq, ck, cv] = project_qkv(added_qkv_.get(), this, *add_q_proj, *add_k_proj, *add_v_proj, context);
    rms_norm_rope_into(*norm_added_q, heads(cq), rope, q, 0);
    rms_norm_rope_into(*norm_added_k, heads(ck), rope, k, 0);
    // Two copies into one buffer rather than ATen's cat of these column slices of the
    // projections: in Flux.1-dev's profile the cat took 95 µs a call, copy_ 38 µs for a slice of
    // the same size into a buffer (the single blocks' attention output).
    v = at::empty({b, s0 + v_in.size(1), h, d}, v_in.options());
    v.narrow(1, 0, s0).copy_(heads(cv));
    v.narrow(1, s0, v_in.size(1)).copy_(heads(v_in));
  } else {
    v = heads(v_in);
  }
  if (patch) {
    TORCH_CHECK(!shard, "Flux attention: sequence parallelism with an image K/V cache");
    const int64_t text = joint ? s0 : patch->text_tokens;
    auto k_image = k.narrow(1, text, k.size(1) - text), v_image = v.narrow(1, text, v.size(1) - text);
    patch->kv->write(k_image, v_image, patch->begin);
    k = at::cat({k.narrow(1, 0, text), k_image}, 1);
    v = at::cat({v.narrow(1, 0, text), v_image}, 1);
  }
  const int64_t tq = q.size(1), tk = k.size(1);
  auto out = shard ? ulysses_attention(q, k, v, *shard)
                   : multi_head_attention(q.reshape({b, tq, h * d}), k.reshape({b, tk, h * d}),
                                          v.reshape({b, tk, h * d}), h);
  if (!joint) return {out, at::Tensor()};
  const int64_t s = context.size(1);
  auto text = to_add_out->forward(out.slice(1, 0, s));
  auto image = to_out[0]->as<Linear>()->forward(out.slice(1, s));
  return {image, text};
}

void FluxAttentionImpl::fuse_projections() {
  qkv_ = FusedLinears::fuse({{this, {to_q.get(), to_k.get(), to_v.get()}}});
  if (options.joint) added_qkv_ = FusedLinears::fuse({{this, {add_q_proj.get(), add_k_proj.get(), add_v_proj.get()}}});
}

FluxTransformerBlockImpl::FluxTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim) {
  norm1 = register_module("norm1", AdaLayerNormZero(dim, false));
  norm1_context = register_module("norm1_context", AdaLayerNormZero(dim, false));
  FluxAttentionOptions o;
  o.dim = dim;
  o.heads = heads;
  o.head_dim = head_dim;
  attn = register_module("attn", FluxAttention(o));
  ff = register_module("ff", FeedForward(dim, 4 * dim, FeedForwardActivation::GELUTanh));
  ff_context = register_module("ff_context", FeedForward(dim, 4 * dim, FeedForwardActivation::GELUTanh));
}

std::pair<at::Tensor, at::Tensor> FluxTransformerBlockImpl::forward(const at::Tensor& x, const at::Tensor& context,
                                                                    const at::Tensor& temb, const FluxRope& rope,
                                                                    const SequenceShard* shard, const FluxPatch* patch) {
  const auto n = norm1->forward(x, temb);
  const auto c = norm1_context->forward(context, temb);
  const auto [attn_out, context_attn_out] = attn->forward(n.x, c.x, rope, shard, patch);
  const auto [h_attn, nh] =
      gated_residual_modulated_layer_norm(x, n.gate_msa, attn_out, n.scale_mlp, n.shift_mlp, kEps);
  const auto h = gated_residual(h_attn, n.gate_mlp, ff->forward(nh));
  const auto [ctx_attn, nc] =
      gated_residual_modulated_layer_norm(context, c.gate_msa, context_attn_out, c.scale_mlp, c.shift_mlp, kEps);
  auto ctx = gated_residual(ctx_attn, c.gate_mlp, ff_context->forward(nc));
  if (ctx.scalar_type() == at::kHalf) ctx = ctx.clamp(-65504, 65504);
  return {ctx, h};
}

FluxSingleTransformerBlockImpl::FluxSingleTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim) {
  norm = register_module("norm", AdaLayerNormZeroSingle(dim));
  proj_mlp = register_module("proj_mlp", Linear(dim, 4 * dim));
  proj_out = register_module("proj_out", Linear(dim + 4 * dim, dim));
  FluxAttentionOptions o;
  o.dim = dim;
  o.heads = heads;
  o.head_dim = head_dim;
  o.joint = false;
  o.pre_only = true;
  attn = register_module("attn", FluxAttention(o));
}

at::Tensor FluxSingleTransformerBlockImpl::forward(const at::Tensor& x, const at::Tensor& temb, const FluxRope& rope,
                                                   const SequenceShard* shard, const FluxPatch* patch) {
  const auto n = norm->forward(x, temb);
  const int64_t dim = x.size(2), hidden = proj_mlp->weight.size(0);
  at::Tensor attn_out, mlp;
  if (in_ && in_->intact()) {
    const auto p = in_->project(n.x);
    mlp = in_->part(p, this, 3);
    attn_out =
        attn->attend(in_->part(p, this, 0), in_->part(p, this, 1), in_->part(p, this, 2), {}, rope, shard, patch).first;
  } else {
    mlp = proj_mlp->forward(n.x);
    attn_out = attn->forward(n.x, {}, rope, shard, patch).first;
  }
  // proj_out reads [attention, GELU(mlp)]: both written into one buffer, no concatenation; in an
  // fp8 job by one kernel that writes the buffer's e4m3 rows too (DIFFRACT_FP8_JOINED_ROWS).
  auto joined = at::empty({x.size(0), x.size(1), dim + hidden}, x.options());
  static const bool joined_rows = options::flag(options::Id::Fp8JoinedRows);  // process scope: read once
  if (!joined_rows || !join_gelu_with_fp8_rows(joined, attn_out, mlp)) {
    auto activated = joined.narrow(2, dim, hidden);
    gelu_tanh_out(activated, mlp);
    joined.narrow(2, 0, dim).copy_(attn_out);
  }
  auto out = gated_residual(x, n.gate, proj_out->forward(joined));
  if (out.scalar_type() == at::kHalf) out = out.clamp(-65504, 65504);
  return out;
}

void FluxSingleTransformerBlockImpl::fuse_projections() {
  in_ = FusedLinears::fuse({{this, {attn->to_q.get(), attn->to_k.get(), attn->to_v.get(), proj_mlp.get()}}});
}

FluxTimeTextEmbeddingsImpl::FluxTimeTextEmbeddingsImpl(int64_t dim, int64_t pooled_dim, bool guidance) {
  timestep_embedder = register_module("timestep_embedder", TimestepEmbedding(256, dim));
  if (guidance) guidance_embedder = register_module("guidance_embedder", TimestepEmbedding(256, dim));
  text_embedder = register_module("text_embedder", TimestepEmbedding(pooled_dim, dim));
}

at::Tensor FluxTimeTextEmbeddingsImpl::forward(const at::Tensor& timestep, const at::Tensor& guidance,
                                               const at::Tensor& pooled) {
  const auto dt = pooled.scalar_type();
  // As diffusers: the scaled values are rounded to the model's dtype before the sinusoids.
  const auto embed = [&](TimestepEmbedding& e, const at::Tensor& v) {
    const auto scaled = v.to(dt) * 1000;
    return e->forward(timestep_embedding(scaled, 256, /*flip_sin_to_cos=*/true, /*downscale_freq_shift=*/0).to(dt));
  };
  auto temb = embed(timestep_embedder, timestep);
  if (guidance_embedder) {
    if (!guidance.defined()) throw Error("Flux transformer: this model (dev) embeds the distilled guidance: give it one");
    temb = temb + embed(guidance_embedder, guidance);
  }
  return temb + text_embedder->forward(pooled);
}

// --- model -------------------------------------------------------------------------------------

FluxTransformer2DModelImpl::FluxTransformer2DModelImpl(const FluxTransformer2DConfig& c) : config(c) {
  c.validate("Flux transformer config");
  const int64_t dim = c.inner_dim();
  time_text_embed =
      register_module("time_text_embed", FluxTimeTextEmbeddings(dim, c.pooled_projection_dim, c.guidance_embeds));
  context_embedder = register_module("context_embedder", Linear(c.joint_attention_dim, dim));
  x_embedder = register_module("x_embedder", Linear(c.in_channels, dim));
  transformer_blocks = register_module("transformer_blocks", nn::ModuleList());
  for (int64_t i = 0; i < c.num_layers; ++i)
    transformer_blocks->push_back(FluxTransformerBlock(dim, c.num_attention_heads, c.attention_head_dim));
  single_transformer_blocks = register_module("single_transformer_blocks", nn::ModuleList());
  for (int64_t i = 0; i < c.num_single_layers; ++i)
    single_transformer_blocks->push_back(FluxSingleTransformerBlock(dim, c.num_attention_heads, c.attention_head_dim));
  norm_out = register_module("norm_out", AdaLayerNormContinuous(dim, dim));
  proj_out = register_module("proj_out", Linear(dim, c.patch_size * c.patch_size * c.out_channels));
}

void FluxTransformer2DModelImpl::fuse_projections() {
  for (const auto& b : *transformer_blocks) b->as<FluxTransformerBlock>()->attn->fuse_projections();
  for (const auto& b : *single_transformer_blocks) b->as<FluxSingleTransformerBlock>()->fuse_projections();
}

FluxRope FluxTransformer2DModelImpl::rope(const at::Tensor& txt_ids, const at::Tensor& img_ids) const {
  return flux_rope(at::cat({txt_ids, img_ids}, 0), config.axes_dims_rope);
}

FluxState FluxTransformer2DModelImpl::embed(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                                            const at::Tensor& pooled_projections, const at::Tensor& timestep,
                                            const at::Tensor& guidance, const FluxRope& rope) {
  TORCH_CHECK(hidden_states.dim() == 3 && hidden_states.size(2) == config.in_channels,
              "Flux transformer: packed latents must be [B, N, ", config.in_channels, "], got ", hidden_states.sizes());
  TORCH_CHECK(encoder_hidden_states.dim() == 3 && encoder_hidden_states.size(2) == config.joint_attention_dim,
              "Flux transformer: text features must be [B, S, ", config.joint_attention_dim, "], got ",
              encoder_hidden_states.sizes());
  const int64_t b = hidden_states.size(0), s = encoder_hidden_states.size(1), n = hidden_states.size(1);
  TORCH_CHECK(rope.cos.size(0) == s + n, "Flux transformer: a rope of ", rope.cos.size(0), " positions for ", s,
              " text and ", n, " image tokens");
  FluxState st;
  const auto t = timestep.dim() == 0 ? timestep.expand({b}) : timestep;
  const auto g = guidance.defined() && guidance.dim() == 0 ? guidance.expand({b}) : guidance;
  st.x = x_embedder->forward(hidden_states);
  st.temb = time_text_embed->forward(t, g, pooled_projections.to(st.x.scalar_type()));
  st.context = context_embedder->forward(encoder_hidden_states);
  st.rope = rope;
  st.text_tokens = s;
  return st;
}

size_t FluxTransformer2DModelImpl::num_blocks() const {
  return transformer_blocks->size() + single_transformer_blocks->size();
}

namespace {

void run_flux_block(FluxTransformer2DModelImpl& m, size_t index, FluxState& s, const FluxPatch* patch) {
  cancel_point();
  const size_t doubles = m.transformer_blocks->size();
  if (index < doubles) {
    TORCH_CHECK(!s.joined, "Flux transformer: a double-stream block after the streams were joined");
    auto [context, x] =
        m.transformer_blocks[index]->as<FluxTransformerBlock>()->forward(s.x, s.context, s.temb, s.rope, s.shard, patch);
    s.context = context;
    s.x = x;
    return;
  }
  if (!s.joined) {
    s.x = at::cat({s.context, s.x}, 1);
    s.context = at::Tensor();
    s.joined = true;
  }
  s.x = m.single_transformer_blocks[index - doubles]->as<FluxSingleTransformerBlock>()->forward(s.x, s.temb, s.rope,
                                                                                                 s.shard, patch);
}

}  // namespace

void FluxTransformer2DModelImpl::run_block(size_t index, FluxState& s) { run_flux_block(*this, index, s, nullptr); }

void FluxTransformer2DModelImpl::run_block(size_t index, FluxState& s, ImageKV& kv, int64_t begin) {
  const FluxPatch patch{&kv, begin, s.text_tokens};
  run_flux_block(*this, index, s, &patch);
}

at::Tensor FluxTransformer2DModelImpl::output(const FluxState& s) {
  const auto image = s.joined ? s.x.slice(1, s.text_tokens) : s.x;
  return proj_out->forward(norm_out->forward(image, s.temb));
}

at::Tensor FluxTransformer2DModelImpl::forward(const at::Tensor& hidden_states, const at::Tensor& encoder_hidden_states,
                                               const at::Tensor& pooled_projections, const at::Tensor& timestep,
                                               const at::Tensor& guidance, const FluxRope& rope,
                                               const SequenceShard* shard) {
  auto s = embed(hidden_states, encoder_hidden_states, pooled_projections, timestep, guidance, rope);
  if (shard) {
    TORCH_CHECK(shard->image_tokens == hidden_states.size(1) && shard->text_tokens == encoder_hidden_states.size(1),
                "Flux transformer: a sequence shard of ", shard->text_tokens, " text and ", shard->image_tokens,
                " image tokens for inputs of ", encoder_hidden_states.size(1), " and ", hidden_states.size(1));
    s.shard = shard;
  }
  for (size_t i = 0; i < num_blocks(); ++i) run_block(i, s);
  return output(s);
}

at::Tensor FluxTransformer2DModelImpl::forward_cached(const at::Tensor& hidden_states,
                                                      const at::Tensor& encoder_hidden_states,
                                                      const at::Tensor& pooled_projections, const at::Tensor& timestep,
                                                      const at::Tensor& guidance, const FluxRope& rope,
                                                      FirstBlockCache& cache) {
  auto s = embed(hidden_states, encoder_hidden_states, pooled_projections, timestep, guidance, rope);
  const auto image = [](const FluxState& st) { return st.joined ? st.x.slice(1, st.text_tokens) : st.x; };
  const auto before = image(s);
  run_block(0, s);
  const auto after_first = image(s);
  const auto first = after_first - before;
  cache.reused = cache.can_reuse(first);
  cache.reused_work = 1.0 / static_cast<double>(num_blocks());
  if (cache.reused) return proj_out->forward(norm_out->forward(after_first + cache.rest_residual, s.temb));
  for (size_t i = 1; i < num_blocks(); ++i) run_block(i, s);
  const auto out = image(s);
  cache.first_residual = first;
  cache.rest_residual = out - after_first;
  return proj_out->forward(norm_out->forward(out, s.temb));
}

at::Tensor FluxTransformer2DModelImpl::forward_teacached(const at::Tensor& hidden_states,
                                                         const at::Tensor& encoder_hidden_states,
                                                         const at::Tensor& pooled_projections,
                                                         const at::Tensor& timestep, const at::Tensor& guidance,
                                                         const FluxRope& rope, TeaCache& cache) {
  auto s = embed(hidden_states, encoder_hidden_states, pooled_projections, timestep, guidance, rope);
  const auto modulated =
      transformer_blocks->size() > 0
          ? transformer_blocks[0]->as<FluxTransformerBlock>()->norm1->forward(s.x, s.temb).x
          : single_transformer_blocks[0]->as<FluxSingleTransformerBlock>()->norm->forward(s.x, s.temb).x;
  cache.reused = cache.can_reuse(modulated);
  cache.reused_work = 0;  // the embedding and one modulation
  const auto before = s.x;  // the image tokens, embedded
  if (cache.reused) return proj_out->forward(norm_out->forward(before + cache.residual, s.temb));
  for (size_t i = 0; i < num_blocks(); ++i) run_block(i, s);
  const auto out = s.joined ? s.x.slice(1, s.text_tokens) : s.x;
  cache.residual = out - before;
  return proj_out->forward(norm_out->forward(out, s.temb));
}

FluxTransformer2DModel load_flux_transformer(const std::filesystem::path& dir, const std::string& variant) {
  const auto config = FluxTransformer2DConfig::from_json(dir / "config.json");
  const auto weights = io::require_weights(dir, variant);
  FluxTransformer2DModel model(config);
  model->eval();
  io::bind(*model, io::load_state_dict(weights), weights.string());
  log::get("models").debug(log::str(dir.string(), ": Flux transformer with ", config.num_layers, " + ",
                                    config.num_single_layers, " blocks, ", config.num_attention_heads, " heads"));
  return model;
}

// --- packing -----------------------------------------------------------------------------------

at::Tensor pack_latents(const at::Tensor& latents) {
  const int64_t b = latents.size(0), c = latents.size(1), h = latents.size(2), w = latents.size(3);
  if (h % 2 != 0 || w % 2 != 0)
    throw Error("Flux: latents of " + std::to_string(h) + "x" + std::to_string(w) + " do not fall into 2x2 patches");
  return latents.view({b, c, h / 2, 2, w / 2, 2}).permute({0, 2, 4, 1, 3, 5}).reshape({b, (h / 2) * (w / 2), c * 4});
}

at::Tensor unpack_latents(const at::Tensor& tokens, int64_t height, int64_t width) {
  const int64_t b = tokens.size(0), c = tokens.size(2) / 4;
  if (tokens.size(1) != (height / 2) * (width / 2) || height % 2 != 0 || width % 2 != 0)
    throw Error("Flux: " + std::to_string(tokens.size(1)) + " tokens for latents of " + std::to_string(height) + "x" +
                std::to_string(width));
  return tokens.view({b, height / 2, width / 2, c, 2, 2}).permute({0, 3, 1, 4, 2, 5}).reshape({b, c, height, width});
}

at::Tensor latent_image_ids(int64_t height, int64_t width, const at::TensorOptions& options) {
  const int64_t h = height / 2, w = width / 2;
  auto ids = at::zeros({h, w, 3}, options.dtype(at::kFloat));
  ids.select(2, 1).add_(at::arange(h, ids.options()).unsqueeze(1));
  ids.select(2, 2).add_(at::arange(w, ids.options()).unsqueeze(0));
  return ids.reshape({h * w, 3}).to(options.dtype());
}

}  // namespace diffract::models
