#include "core/io/dtype.h"

#include <array>
#include <utility>

namespace diffract::io {
namespace {
constexpr std::array<std::pair<std::string_view, DType>, 12> kNames{{
    {"F64", DType::F64},   {"F32", DType::F32},         {"F16", DType::F16},
    {"BF16", DType::BF16}, {"F8_E4M3", DType::F8_E4M3}, {"F8_E5M2", DType::F8_E5M2},
    {"I64", DType::I64},   {"I32", DType::I32},         {"I16", DType::I16},
    {"I8", DType::I8},     {"U8", DType::U8},           {"BOOL", DType::BOOL},
}};
}  // namespace

std::optional<DType> parse_dtype(std::string_view name) {
  for (const auto& [n, d] : kNames)
    if (n == name) return d;
  return std::nullopt;
}

std::string_view dtype_name(DType dtype) {
  for (const auto& [n, d] : kNames)
    if (d == dtype) return n;
  return "?";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::F8_E4M3: case DType::F8_E5M2: case DType::I8: case DType::U8: case DType::BOOL: return 1;
  }
  return 0;
}

}  // namespace diffract::io
