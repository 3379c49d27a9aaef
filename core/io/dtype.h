#pragma once
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace diffract::io {

// Element types found in checkpoints, named as safetensors names them.
enum class DType { F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8, BOOL };

std::optional<DType> parse_dtype(std::string_view safetensors_name);
std::string_view dtype_name(DType dtype);
std::size_t dtype_size(DType dtype);

}  // namespace diffract::io
