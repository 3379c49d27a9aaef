#pragma once
// Timing GPU work on a stream apart from the host's launch cost, for the choices made by timing
// (gemm_cuda.cpp's algorithms, fp8_cuda.cpp's fp8 or bf16). CUDA builds with the kernels only.
#include <cuda_runtime.h>

#include "core/models/common/spin_kernel.h"

namespace diffract::models {

// ms per call of f() on `stream`, after a warm-up call: the GPU's time alone, the calls queued
// behind a spinning kernel so that they run back to back whatever their launches cost (in a CUDA
// graph replay, what counts).
template <typename F>
double time_ms(cudaStream_t stream, F&& f) {
  f();
  cudaEvent_t start, end;
  cudaEventCreate(&start);
  cudaEventCreate(&end);
  constexpr int reps = 10;
  kernels::spin(stream, 1'000'000);  // 1 ms: longer than the host takes to enqueue the calls
  cudaEventRecord(start, stream);
  for (int i = 0; i < reps; ++i) f();
  cudaEventRecord(end, stream);
  cudaEventSynchronize(end);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, end);
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  return static_cast<double>(ms) / reps;
}

}  // namespace diffract::models
