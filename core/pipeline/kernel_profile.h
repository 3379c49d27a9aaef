#pragma once
// Where the device time of a function goes, and how long it takes: its CUDA kernels under the Kineto profiler, summed by
// kernel name, by a rough family (attention, matmul, normalisation, ...) and by the ATen op (with
// its input shapes) that launched them, in ms per call. Kernel names are the libraries' own.
#include <cstdint>
#include <functional>

#include <nlohmann/json.hpp>

namespace diffract::pipeline {

// Runs `f` once to warm up, then `reps` times under the profiler on CUDA device `device`.
nlohmann::json kernel_profile(int reps, const std::function<void()>& f, int device);

// The wall time of one call of `f` on CUDA device `device`, in ms: `warmups` calls first, then the
// mean of `reps` between two device synchronisations.
double mean_cuda_ms(int reps, const std::function<void()>& f, int device, int warmups = 1);

// A transformer step's report for the bench: {"size", "tokens", "eager_ms", "graph_ms" (each
// mean_cuda_ms over `reps`), "kernels" (kernel_profile of the eager step)}.
nlohmann::json step_profile(int size, std::int64_t tokens, int reps, const std::function<void()>& eager,
                            const std::function<void()>& graphed, int device);

}  // namespace diffract::pipeline
