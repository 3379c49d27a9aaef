#pragma once
// A convolution's per-channel bias, and optionally a residual, added to its output in one
// vectorised kernel. Why: ATen runs cuDNN's convolution and then `output.add_(bias.view(1, C, 1,
// 1))`, a broadcast add that TensorIterator cannot vectorise (docs/benchmarks.md), and a ResNet
// block's skip connection is one more pass over the activations. Plain
// C++ over raw pointers, like the other kernels; models::Conv2d (layers.h) is the caller.
#include <cstdint>

#include "core/models/common/group_norm_kernels.h"  // kernels::DType

struct CUstream_st;

namespace diffract::models::kernels {

struct BiasAddArgs {
  void* y = nullptr;               // [n, c, h, w] in place: NCHW- or channels-last-contiguous
  const void* bias = nullptr;      // [c], dtype
  const void* residual = nullptr;  // optional, y's shape and memory format
  const void* residual_bias = nullptr;  // optional with a residual: [c], added with it
  int64_t numel = 0, c = 0;
  int64_t plane = 1;               // h * w for NCHW; 1 for channels-last (the channel innermost)
  DType dtype = DType::BFloat16;
};

// y = y + bias[channel] (+ residual (+ residual_bias[channel])), each sum in fp32 and rounded once. Returns the CUDA error
// code of the launch (0: ok), or cudaErrorInvalidValue for arguments it does not take.
int bias_add(const BiasAddArgs& a, CUstream_st* stream);

}  // namespace diffract::models::kernels
