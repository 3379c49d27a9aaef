#pragma once
// A kernel that only waits, for timing GPU work apart from the host's launch cost: enqueued
// first, it holds the stream while the host enqueues what is to be timed, which then runs back
// to back (gemm_cuda.cpp times GEMMs of ~10 us this way, whose launches cost as much).
#include <cstdint>

struct CUstream_st;

namespace diffract::models::kernels {

// One thread that returns `nanoseconds` after it starts (the GPU's global timer). Returns the
// CUDA error code of the launch (0: ok).
int spin(CUstream_st* stream, uint64_t nanoseconds);

}  // namespace diffract::models::kernels
