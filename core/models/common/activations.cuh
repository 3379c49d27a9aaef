#pragma once
// The activations the .cu kernels apply, each with ATen's arithmetic operation for operation, so
// a kernel's output equals ATen's op's bit for bit.
#include <cmath>

#include <cuda_runtime.h>

namespace diffract::models::kernels {

// GEGLU's gate a * gelu(b) with the exact (erf) GELU.
__device__ __forceinline__ float gated(float a, float b) { return a * (0.5f * b * (1.f + erff(b * 0.70710678118654752f))); }

// ATen's tanh GELU (its constants rounded to float as it rounds them).
__device__ __forceinline__ float gelu_tanh(float x) {
  constexpr float kBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
  constexpr float kKappa = 0.044715f;
  const float cube = x * x * x;
  const float inner = kBeta * (x + kKappa * cube);
  return 0.5f * x * (1.f + tanhf(inner));
}

}  // namespace diffract::models::kernels
