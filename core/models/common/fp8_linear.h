#pragma once
// FP8 (e4m3) linear layers. A job whose precision is fp8 (job::GenerationRequest::precision, the
// job-scope DIFFRACT_PRECISION) runs its denoiser's linear layers with e4m3 weights (one scale
// per output channel, quantised from the model's own on the first fp8 call and kept beside them)
// and e4m3 activations (one scale per token, made by one kernel: fp8_kernels.h), multiplied by
// at::_scaled_mm with both scales and the bias in its epilogue, bf16 out.
//  Which layers: those allow_fp8() marked (the pipelines mark their denoiser's; text encoders,
//   VAEs and ControlNets keep their dtype) whose K and N are multiples of 16. On CUDA each
//   layer shape is timed on its first fp8 call (outside graph captures) against the layer's bf16
//   GEMM and keeps the faster: small GEMMs gain nothing from fp8 and lose the quantisation
//   (shared/anchors: fp8 GEMMs 1.6-1.8x at DiT shapes, none at small UNet ones). Needs an
//   sm_89+ GPU (fp8 tensor cores) and a bf16 model; elsewhere on CUDA the layers stay bf16.
//   DIFFRACT_FP8_LAYERS=all skips the timing: every eligible layer runs in fp8.
//  On the CPU the same arithmetic is emulated in fp32 (both operands rounded to e4m3 with their
//   scales, the product in fp32) on every eligible layer, so tests and the quality report see
//   fp8's rounding (the GPU's fast accumulation aside).
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

namespace diffract::models {

// A weight [N, K] as e4m3 with one scale per output channel: W ~ weight * scale^T.
struct Fp8Weight {
  at::Tensor weight;  // [N, K] float8_e4m3fn, on the weight's device
  at::Tensor scale;   // [1, N] float32
};

// Per output row: scale = max(amax * (1 / 448), 1e-12), weight = e4m3(w * (1 / scale)), saturated.
Fp8Weight quantize_weight_fp8(const at::Tensor& w);
// x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]), per row as quantize_weight_fp8 (the CUDA
// kernel's arithmetic, here in ATen ops on x's device).
std::pair<at::Tensor, at::Tensor> quantize_rows_fp8(const at::Tensor& x);
// The same by the CUDA kernel (fp8_kernels.h) for a CUDA x: a diffract::Error in builds without it.
std::pair<at::Tensor, at::Tensor> quantize_rows_fp8_kernel(const at::Tensor& x);
// x [M, K] @ W^T + bias from the e4m3 operands and their scales, emulated in fp32 (any device),
// in `out` dtype: the reference the CUDA path is checked against.
at::Tensor scaled_linear_fp8_reference(const at::Tensor& q, const at::Tensor& x_scale, const Fp8Weight& w,
                                       const at::Tensor& bias, at::ScalarType out);

// A layer's e4m3 weight, made from its weight on first use and again when that tensor changed
// (another storage: a move, a replica) or invalidate_fp8_weights() was called since (weights
// patched in place: a LoRA). Thread-safe (CPU ranks share a model).
class Fp8WeightCache {
 public:
  std::shared_ptr<const Fp8Weight> get(const at::Tensor& weight);

 private:
  std::mutex mutex_;
  std::shared_ptr<const Fp8Weight> fp8_;
  const void* source_ = nullptr;
  std::uint64_t generation_ = 0;
};

// The layer x [..., K] @ weight^T + bias in fp8, or an undefined tensor where it runs in its own
// dtype: no cache (not marked), the job does not want fp8, K or N not multiples of 16, or on
// CUDA a GPU without fp8, a non-bf16 x, or a shape whose timing kept bf16.
at::Tensor fp8_linear(const at::Tensor& x, Fp8WeightCache* cache, const at::Tensor& weight, const at::Tensor& bias);

// Whether the job on this thread wants fp8 (DIFFRACT_PRECISION is "fp8").
bool fp8_wanted();
// Marks every Linear below `root` (root included) as free to run in fp8; returns how many.
int allow_fp8(torch::nn::Module& root);
// Every e4m3 weight made so far is stale (the model's weights changed in place).
void invalidate_fp8_weights();
// Every CUDA shape timed so far, as JSON: ms per call in bf16 and in fp8 (quantisation included,
// and alone), and the one kept.
std::string fp8_tuning_report();

}  // namespace diffract::models
