#pragma once
// What the timed choices of gemm_cuda.cpp, fp8_cuda.cpp and conv_cuda.cpp share: the tuning store
// of the GPU they run on (io/tuning_store.h; its identity is the GPU model, the driver and the
// CUDA, cuBLASLt, cuDNN and LibTorch versions) and the counts behind tuning_stats(). CUDA builds
// with the kernels only.
#include <cuda_runtime.h>

#include <string>

#include "core/io/tuning_store.h"

namespace diffract::models {

io::TuningStore& tuning_store_for(int device);

// Whether `stream` is capturing a CUDA graph: nothing may be timed then, so a shape without a
// choice yet takes its untimed path.
bool capturing(cudaStream_t stream);

// One shape's choice was made: timed (`ms` spent timing it) or taken from the store.
void count_tuning(const std::string& kind, bool from_store, double ms);

// Milliseconds between two steady-clock points, for the timing's own cost.
double ms_between(long long start_ns, long long end_ns);
long long now_ns();

}  // namespace diffract::models
