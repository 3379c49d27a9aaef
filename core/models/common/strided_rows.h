#pragma once
// A tensor seen as rows of its last dimension, for kernels and GEMMs that take one stride between
// rows: column slices of wider tensors are such rows; a slice along a middle dimension of a batch
// (SD3's image tokens of its joint sequence, per batch item) is not.
#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

namespace diffract::models {

struct StridedRows {
  std::int64_t rows = 0, cols = 0, stride = 0;  // stride: elements from one row's start to the next
};

// {rows, cols, stride} where the last dimension is contiguous and every other dimension folds into
// one evenly strided run of rows; nothing otherwise.
inline std::optional<StridedRows> strided_rows(const at::Tensor& t) {
  if (t.dim() < 1 || t.stride(-1) != 1) return std::nullopt;
  const std::int64_t cols = t.size(-1);
  std::int64_t rows = 1, stride = cols;  // stride: set by the innermost dimension of more than one
  for (std::int64_t i = t.dim() - 2; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (rows == 1) {
      stride = t.stride(i);
    } else if (t.stride(i) != rows * stride) {
      return std::nullopt;
    }
    rows *= t.size(i);
  }
  return StridedRows{rows, cols, stride};
}

}  // namespace diffract::models
