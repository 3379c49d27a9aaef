#pragma once
// Rotary position embeddings over interleaved pairs (diffusers' apply_rotary_emb with
// use_real_unbind_dim = -1, as Flux uses them), and the RMSNorm of queries and keys fused with
// them: on CUDA for fp16 / bf16 heads one kernel of our own (rotary_kernels.h), elsewhere ATen.
#include <cstdint>

#include <ATen/core/Tensor.h>

#include "core/models/common/normalization.h"

namespace diffract::models {

// cos and sin [S, D] in float32, each frequency repeated for its pair.
struct Rope {
  at::Tensor cos, sin;
};

// x [B, S, H, D] -> the same shape: (x * cos + rotate(x) * sin) in float32, in x's dtype.
at::Tensor apply_rope(const at::Tensor& x, const Rope& rope);

// out.narrow(1, offset, T) = apply_rope(norm(x), rope rows offset .. offset + T), for x
// [B, T, H, D] (the last dimension contiguous) and out [B, T', H, D] contiguous. The kernel's
// result equals ATen's but for the sum of squares' order.
void rms_norm_rope_into(RMSNormImpl& norm, const at::Tensor& x, const Rope& rope, at::Tensor& out, int64_t offset);
// Whether CUDA tensors take the kernel: built with it and DIFFRACT_FUSED_RMS_NORM_ROPE not 0;
// set_fused_rms_norm_rope switches it (the GPU check compares both).
bool fused_rms_norm_rope_available();
void set_fused_rms_norm_rope(bool on);

}  // namespace diffract::models
