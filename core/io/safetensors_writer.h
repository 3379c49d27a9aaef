#pragma once
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace diffract::io {

// Writes tensors (any device, contiguous or not; f64/f32/f16/bf16/i64/i32/i16/i8/u8/bool) as a
// safetensors file: an 8-byte little-endian header length, the JSON header padded with spaces
// to a multiple of 8, then the data in the given order. Names must be unique and non-empty.
// Written to `path`.tmp first and renamed, so a reader never sees half a file.
void write_safetensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace diffract::io
