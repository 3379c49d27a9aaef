#include "core/models/common/spin_kernel.h"

#include <cuda_runtime.h>

namespace diffract::models::kernels {
namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(uint64_t ns) {
  const uint64_t start = global_ns();
  while (global_ns() - start < ns) __nanosleep(1000);
}

}  // namespace

int spin(CUstream_st* stream, uint64_t nanoseconds) {
  spin_kernel<<<1, 1, 0, stream>>>(nanoseconds);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace diffract::models::kernels
