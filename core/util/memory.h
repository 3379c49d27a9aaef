#pragma once
// Whether a model fits before it is built: a config from a file can ask for terabytes, which the
// allocator would answer with an abort, not an error.
#include <cstdint>
#include <string>

namespace diffract {

// This machine's physical memory in bytes.
std::uint64_t physical_memory_bytes();

// An Error naming `what` when `parameters` fp32 values (as modules are built, before their
// weights are bound) exceed the physical memory.
void check_fits_in_memory(std::int64_t parameters, const std::string& what);

// At least about how many bytes decoding `batch` images of width x height takes at its peak:
// the VAE decoders of SD 1.x / 2.x / XL / 3 and FLUX.1 end at full size in 256- and 128-channel
// blocks, where some five [batch, 128, H, W] activations' worth are alive at once. `value_bytes`:
// 4 in fp32 (the CPU), 2 in bf16 (a GPU). For a warning before a job, not a bound.
double decode_peak_bytes(int width, int height, int batch, int value_bytes);

}  // namespace diffract
