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

}  // namespace diffract
