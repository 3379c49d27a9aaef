#include "core/models/common/embeddings.h"

#include <cmath>

#include <ATen/ATen.h>

namespace diffract::models {

at::Tensor timestep_embedding(const at::Tensor& t, int64_t dim, bool flip_sin_to_cos, double downscale_freq_shift,
                              double max_period) {
  const int64_t half = dim / 2;
  auto opts = at::TensorOptions().dtype(at::kFloat).device(t.device());
  auto exponent = at::arange(half, opts) * (-std::log(max_period)) / (half - downscale_freq_shift);
  auto args = t.to(at::kFloat).unsqueeze(1) * at::exp(exponent).unsqueeze(0);
  auto emb = flip_sin_to_cos ? at::cat({at::cos(args), at::sin(args)}, -1) : at::cat({at::sin(args), at::cos(args)}, -1);
  if (dim % 2 == 1) emb = at::constant_pad_nd(emb, {0, 1}, 0);
  return emb;
}

TimestepEmbeddingImpl::TimestepEmbeddingImpl(int64_t in_channels, int64_t time_embed_dim, int64_t out_dim) {
  linear_1 = register_module("linear_1", Linear(in_channels, time_embed_dim));
  linear_2 = register_module("linear_2", Linear(time_embed_dim, out_dim > 0 ? out_dim : time_embed_dim));
}

at::Tensor TimestepEmbeddingImpl::forward(const at::Tensor& x) {
  return linear_2->forward(at::silu(linear_1->forward(x)));
}

}  // namespace diffract::models
