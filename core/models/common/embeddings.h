#pragma once
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "core/models/common/layers.h"

namespace diffract::models {

// Sinusoidal embedding of (fractional) timesteps, as diffusers' get_timestep_embedding.
// t: [B] -> [B, dim], float32.
at::Tensor timestep_embedding(const at::Tensor& t, int64_t dim, bool flip_sin_to_cos, double downscale_freq_shift,
                              double max_period = 10000.0);

// diffusers' TimestepEmbedding: linear_1, SiLU, linear_2.
class TimestepEmbeddingImpl : public torch::nn::Module {
 public:
  TimestepEmbeddingImpl(int64_t in_channels, int64_t time_embed_dim, int64_t out_dim = 0);
  at::Tensor forward(const at::Tensor& x);  // [B, in] -> [B, out]
  Linear linear_1{nullptr}, linear_2{nullptr};
};
TORCH_MODULE(TimestepEmbedding);

}  // namespace diffract::models
