#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace diffract::models {

class Fp8WeightCache;

// Linear, Conv2d and Embedding without random initialisation. LibTorch's torch::nn versions
// run kaiming_uniform_ / normal_ over every parameter in their constructors; the weights of a
// loaded model are bound over them right after, so that work (31 s for SDXL's UNet on the CPU)
// is thrown away. These allocate uninitialised parameters (at::empty) under the same names,
// "weight" and "bias", so checkpoint keys bind as with torch::nn. Linear runs at::linear, which folds
// the bias into the GEMM; LibTorch's Linear::forward multiplies and then adds the bias in a
// separate broadcast kernel for inputs of 3+ dims (measured slower, docs/benchmarks.md).
// A model meant to run on random weights calls init_random() below.

struct LinearOptions {
  LinearOptions(int64_t in_features, int64_t out_features) : in_features(in_features), out_features(out_features) {}
  LinearOptions& bias(bool b) { with_bias = b; return *this; }
  int64_t in_features, out_features;
  bool with_bias = true;
};

class LinearImpl : public torch::nn::Module {
 public:
  explicit LinearImpl(const LinearOptions& o);
  LinearImpl(int64_t in_features, int64_t out_features) : LinearImpl(LinearOptions(in_features, out_features)) {}
  // x @ W^T + b (at::linear), or in fp8 where the layer may and the job wants it (fp8_linear.h).
  at::Tensor forward(const at::Tensor& x);
  LinearOptions options;
  at::Tensor weight;  // [out, in]
  at::Tensor bias;    // [out] or undefined
  uint64_t construction_index;  // see init_random
  std::shared_ptr<Fp8WeightCache> fp8;  // set by allow_fp8: the layer may run in fp8
};
TORCH_MODULE(Linear);

struct Conv2dOptions {
  Conv2dOptions(int64_t in_channels, int64_t out_channels, int64_t kernel_size)
      : in_channels(in_channels), out_channels(out_channels), kernel(kernel_size) {}
  Conv2dOptions& stride(int64_t s) { stride_ = s; return *this; }
  Conv2dOptions& padding(int64_t p) { padding_ = p; return *this; }
  Conv2dOptions& bias(bool b) { with_bias = b; return *this; }
  int64_t in_channels, out_channels, kernel;
  int64_t stride_ = 1, padding_ = 0;  // square, zero padding, no dilation, no groups
  bool with_bias = true;
};

class Conv2dImpl : public torch::nn::Module {
 public:
  explicit Conv2dImpl(const Conv2dOptions& o);
  // x [N, in, H, W] -> conv2d(x) + bias. On CUDA the bias goes in through one vectorised kernel
  // (bias_add_kernels.h) rather than ATen's broadcast add_ after cuDNN. One argument: TAESD
  // holds these in torch::nn::Sequential.
  at::Tensor forward(const at::Tensor& x);
  // conv2d(x) + bias + residual ([N, out, H', W'], the output's memory format) + residual_bias
  // ([out], optional: the bias of the 1x1 convolution that made the residual, left to this add),
  // on CUDA in the same kernel.
  at::Tensor forward_add(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& residual_bias = {});
  // The convolution alone, for a caller that adds the bias itself (a ResNet block hands it to
  // the GroupNorm that reads the output). No patch-parallel context may be active.
  at::Tensor forward_without_bias(const at::Tensor& x);
  Conv2dOptions options;
  at::Tensor weight;  // [out, in, k, k]
  at::Tensor bias;    // [out] or undefined
  uint64_t construction_index;  // see init_random
};
TORCH_MODULE(Conv2d);

// Whether Conv2d adds its bias (and residual) through the CUDA kernel and ResNet blocks fold the
// first convolution's bias into their GroupNorm: built with the kernels and not switched off
// (set_conv_bias_kernel, or DIFFRACT_CONV_BIAS_KERNEL=0 in the environment at start-up).
bool conv_bias_kernel_available();
void set_conv_bias_kernel(bool on);

class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim);
  at::Tensor forward(const at::Tensor& ids);  // at::embedding
  int64_t num_embeddings, embedding_dim;
  at::Tensor weight;  // [num, dim]
  uint64_t construction_index;  // see init_random
};
TORCH_MODULE(Embedding);

// x [..., K] weight[N, K]^T + bias[N] -> [..., N], what every Linear layer runs: at::linear, or
// on CUDA in inference (bf16 / fp16, x contiguous) a cuBLASLt GEMM whose algorithm the shape's
// first call chose by timing cuBLASLt's proposals against at::linear (gemm_cuda.cpp). Its first
// call inside a CUDA graph capture, with no choice made yet, stays with at::linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
// linear(x, weight, bias) written into `out` [..., N], a view (e.g. one stream's tokens of a joint
// sequence another projection fills too). With DIFFRACT_GEMM_STRIDED_BATCH=1, where x and out are
// [B, T, *] with each batch item's rows contiguous and adjacent, one strided-batch cuBLASLt GEMM
// writes there (and linear() reads such an x in place, without gemm_input's copy); elsewhere
// linear() and a copy.
void linear_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
// Whether DIFFRACT_GEMM_STRIDED_BATCH is on (read once).
bool gemm_strided_batch_enabled();
// gelu(linear(x, weight, bias)) with the tanh approximation, what diffusers' GELU(approximate=
// "tanh") projection runs. On CUDA (unless DIFFRACT_GEMM_GELU=0) the GELU runs in the epilogue of the
// tuned cuBLASLt GEMM, on the fp32 accumulator before the rounding to x's dtype, instead of as a
// pass of its own over the output (where the timing keeps cuBLASLt for the shape).
at::Tensor linear_gelu_tanh(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
// Whether linear() tunes (default on; DIFFRACT_GEMM_TUNING=0 at start-up turns it off).
bool gemm_tuning_enabled();
void set_gemm_tuning(bool on);
// Every shape tuned so far, as JSON: ms per call of at::linear, of cuBLASLt's first proposal
// and of the one kept.
std::string gemm_tuning_report();

// conv2d(x, weight, bias) with square stride and zero padding, what Conv2d runs: at::conv2d, or
// on CUDA for bf16 / fp16 cuDNN's convolution with the plan DIFFRACT_CONV_TUNING picks
// (conv_cuda.cpp: cuDNN's heuristic plan by default; `timed` times it against the benchmarked
// one per shape). Under `timed`, a shape's first call inside a CUDA graph capture, with no choice
// made yet, takes ATen's path.
at::Tensor conv2d(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t stride,
                  int64_t padding);
// Every convolution shape timed so far, as JSON: ms per call of either plan, and the one kept.
std::string conv_tuning_report();
// What the timing choices cost in this process, per kind ("gemm", "conv", "fp8"): shapes timed,
// shapes whose choice came from the tuning store (io/tuning_store.h), and the ms spent timing. JSON.
std::string tuning_stats();
// Saves the choices made since the last save to the tuning store's files (a no-op without changes).
void save_tuning();

// GroupNorm with its affine weight and bias ("weight", "bias": ones and zeros until bound),
// as torch::nn::GroupNorm, plus what the UNet runs around it: forward(x, add, silu, channel_add)
// is silu(group_norm(x + add[:, :, None, None] + channel_add[None, :, None, None])) with add
// [N, C] or [1, C] (a ResNet block's time embedding) and channel_add [C] (the bias of the
// convolution before it).
// On CUDA, for 4-D NCHW or channels-last input, it runs our kernels (group_norm_kernels.h):
// channels-last in, channels-last out. Elsewhere ATen's group_norm.
struct GroupNormOptions {
  GroupNormOptions(int64_t groups, int64_t channels) : groups(groups), channels(channels) {}
  GroupNormOptions& eps(double e) { eps_ = e; return *this; }
  int64_t groups, channels;
  double eps_ = 1e-5;
};

class GroupNormImpl : public torch::nn::Module {
 public:
  explicit GroupNormImpl(const GroupNormOptions& o);
  // x [N, C, *] -> the same shape and memory format; add: undefined, [N, C] or [1, C] (its rows
  // may lie apart, as slices of a wider tensor do); channel_add: undefined or [C].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& add = {}, bool silu = false,
                     const at::Tensor& channel_add = {});
  GroupNormOptions options;
  at::Tensor weight;  // [C]
  at::Tensor bias;    // [C]
};
TORCH_MODULE(GroupNorm);

// Whether GroupNorm uses the CUDA kernels where they apply (default: built with them); the
// benchmark turns them off to measure ATen's path.
bool fused_group_norm_available();
void set_fused_group_norm(bool on);
bool fused_group_norm_enabled();
// The kernels' statistics pass aims at this many blocks per SM (default 2, or
// DIFFRACT_GROUP_NORM_STATS_BLOCKS at start-up; <= 0 resets it): more blocks read in parallel,
// fewer leave less for the finalize kernel to sum. For the GPU check's timing runs.
void set_group_norm_stats_blocks_per_sm(int blocks);
int group_norm_stats_blocks_per_sm();

// Every 4-D parameter of `module` (convolution weights) in memory format `format`, in place.
// cuDNN runs its NHWC kernels on channels-last weights and inputs without converting them first.
void set_memory_format(torch::nn::Module& module, at::MemoryFormat format);

// Random weights for every Linear, Conv2d and Embedding in `module`, drawn as LibTorch's
// constructors drew them: kaiming_uniform_(a = sqrt(5)) on a weight and uniform(+-1/sqrt(fan_in))
// on its bias; normal(0, 1) on an embedding. Layers are drawn for in the order they were
// constructed (a process-wide count; registration order can differ: FeedForward builds net.2
// before net.0), so a model built after at::manual_seed(s) and then given init_random(model)
// holds the values the torch::nn layers gave it, and the generator ends where theirs did.
// Draws come from the CPU `generator` (default: the global one) in fp32 and are copied to
// parameters that live elsewhere or in another dtype; a CUDA generator draws in place on its
// GPU in the parameters' dtype (other values, much faster for billions of weights). Norm layers
// keep their ones / zeros.
void init_random(torch::nn::Module& module, at::Generator generator = {});
// `module` moved to `device` in `dtype` with its Linear, Conv2d and Embedding weights and biases
// left uninitialised there instead of copied (norms and buffers are copied): a large model
// built for init_random without a host copy of its weights.
void empty_parameters_on(torch::nn::Module& module, const at::Device& device, at::ScalarType dtype);
// The same from a generator seeded with `seed` (as at::manual_seed(seed) seeds the global one).
void init_random(torch::nn::Module& module, uint64_t seed);

}  // namespace diffract::models
