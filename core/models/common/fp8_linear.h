#pragma once
// FP8 (e4m3) linear layers. A job whose precision is fp8 (job::GenerationRequest::precision, the
// job-scope DIFFRACT_PRECISION) runs its denoiser's linear layers with e4m3 weights (one scale
// per output channel, quantised from the model's own on the first fp8 call and kept beside them)
// and e4m3 activations (one scale per token, made by one kernel: fp8_kernels.h), multiplied by
// at::_scaled_mm with both scales and the bias in its epilogue, bf16 out.
//  Which layers: those allow_fp8() marked (the pipelines mark their denoiser's; text encoders,
//   VAEs and ControlNets keep their dtype) whose K and N are multiples of 16. On CUDA each
//   layer shape is timed on its first fp8 call (outside graph captures) against the layer's bf16
//   GEMM and keeps fp8 only where it saves at least 5 % (fp8_cuda.cpp): small GEMMs gain nothing
//   from fp8 and lose the quantisation (shared/anchors: fp8 GEMMs 1.6-1.8x at DiT shapes, none at
//   small UNet ones). Where a kernel offered the input's e4m3 rows (offer_fp8_rows), the shape
//   is timed with them, without a quantisation pass. Needs an sm_89+ GPU (fp8 tensor cores) and
//   a bf16 model; elsewhere on CUDA the layers stay bf16.
//   DIFFRACT_FP8_LAYERS=all skips the timing: every eligible layer runs in fp8.
//  On the CPU the same arithmetic is emulated in fp32 (both operands rounded to e4m3 with their
//   scales, the product in fp32) on every eligible layer, so tests and the quality report see
//   fp8's rounding (the GPU's fast accumulation aside).
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
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
// The same by the CUDA kernel (fp8_kernels.h) for a CUDA x [..., K], read where it lies (rows
// [M, K] out): a diffract::Error in builds without it.
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
  // Whether get(weight) would return the e4m3 weight already made, without making it.
  bool ready_for(const at::Tensor& weight);

 private:
  bool made_from(const at::Tensor& weight, std::uint64_t generation) const;  // mutex_ held
  std::mutex mutex_;
  std::shared_ptr<const Fp8Weight> fp8_;
  const void* source_ = nullptr;
  std::uint64_t generation_ = 0;
};

// The layer x [..., K] @ weight^T + bias in fp8, or an undefined tensor where it runs in its own
// dtype: no cache (not marked), the job does not want fp8, K or N not multiples of 16, or on
// CUDA a GPU without fp8, a non-bf16 x, or a shape whose timing kept bf16. Rows offered for x
// (offer_fp8_rows) are taken instead of quantising x; on CUDA a strided x (a slice of tokens of a
// joint sequence) is quantised where it lies, without a contiguous copy first.
at::Tensor fp8_linear(const at::Tensor& x, Fp8WeightCache* cache, const at::Tensor& weight, const at::Tensor& bias);

// The e4m3 rows of an activation x [..., K], made by the kernel that wrote x itself (the
// LayerNorms, an fp8 MLP's GELU or GEGLU gate): q [M, K] float8_e4m3fn and scale [M, 1] float32,
// M = x.numel() / K, equal to quantize_rows_fp8(x.reshape({-1, K})).
struct Fp8Rows {
  at::Tensor q, scale;
};
// Whether a kernel writing an activation like x should write its e4m3 rows as well and offer
// them: DIFFRACT_FP8_FUSED_ROWS is on, the job wants fp8, x is a bf16 CUDA tensor on an
// fp8-capable GPU whose width is a multiple of 16, and the layers timed so far with offered rows
// of x's count and width have not all kept bf16 (then the rows would go unread).
bool fp8_rows_wanted(const at::Tensor& x);
// Offers x's rows to the fp8_linear calls of x on this thread, which take them instead of
// quantising x. A few offers are held at a time (a DiT block normalises its image and its text
// tokens before projecting either), the oldest dropped first; an offer matches an x of the same
// data, shape, strides and version, so an x changed by ATen's ops since is quantised anew. The
// producer writes x before offering and not after.
void offer_fp8_rows(const at::Tensor& x, Fp8Rows rows);
// The rows offered for x on this thread, left in place (the GPU check reads them); nothing where
// none stands for x as it is now.
std::optional<Fp8Rows> offered_fp8_rows(const at::Tensor& x);
// Drops this thread's offers (their memory with them).
void drop_fp8_rows();
// Since the process started, calls made on the host (a CUDA graph's replays add nothing): rows
// offered, fp8 GEMMs that took offered rows, and fp8 GEMMs that quantised their input in a pass
// of their own.
struct Fp8RowsCounts {
  std::int64_t offered = 0, taken = 0, quantised = 0;
};
Fp8RowsCounts fp8_rows_counts();
// An fp8 MLP's activation between its two layers, applied to the first layer's output y.
enum class Fp8RowsActivation {
  GeluTanh,     // gelu(y, "tanh"): y [..., N] -> [..., N]
  GegluHalves,  // GEGLU's gate over y's halves (geglu.h): y [..., 2 I] -> [..., I]
};
// The activation by one kernel that writes its e4m3 rows beside it and offers them, where
// fp8_rows_wanted says the next layer takes them: bit for bit ATen's op (at::gelu, geglu_halves).
// Elsewhere (and for a y the kernel cannot read: not bf16 CUDA, rows not one stride apart) an
// undefined tensor, and the caller runs its op as before.
at::Tensor activation_with_fp8_rows(const at::Tensor& y, Fp8RowsActivation act);
// joined [..., P + N] = [prefix, gelu(y, "tanh")] along the last dimension (Flux's single blocks:
// the attention's output, then the MLP's activation, both proj_out's input) by one kernel that
// writes joined's e4m3 rows beside it and offers them, where fp8_rows_wanted(joined) says
// proj_out takes them: bit for bit the two written apart. False where it does not take the case
// (then nothing is written): joined contiguous, prefix [..., P] and y [..., N] rows of one stride
// each, bf16 CUDA, P and N multiples of 8.
bool join_gelu_with_fp8_rows(at::Tensor& joined, const at::Tensor& prefix, const at::Tensor& y);

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
