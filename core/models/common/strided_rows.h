#pragma once
// A tensor seen as rows of its last dimension, for kernels and GEMMs that take one stride between
// rows: column slices of wider tensors are such rows; a slice along a middle dimension of a batch
// (SD3's image tokens of its joint sequence, per batch item) is not, but is batch items of such
// rows (strided_row_batches), which the fp8 quantisation kernel reads.
#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

namespace diffract::models {

struct StridedRows {
  std::int64_t rows = 0, cols = 0, stride = 0;  // stride: elements from one row's start to the next
};

// A tensor seen as batch items of evenly strided rows, the items evenly strided too: row r
// starts at (r / rows_per_batch) * batch_stride + (r % rows_per_batch) * row_stride elements.
struct StridedRowBatches {
  std::int64_t rows_per_batch = 0, batches = 0, cols = 0, row_stride = 0, batch_stride = 0;
};

// The last dimension contiguous, the others folding into at most two levels (rows, then batch
// items); nothing otherwise. With one level, batches is 1 and batch_stride rows_per_batch *
// row_stride.
inline std::optional<StridedRowBatches> strided_row_batches(const at::Tensor& t) {
  if (t.dim() < 1 || t.stride(-1) != 1) return std::nullopt;
  StridedRowBatches b{1, 1, t.size(-1), t.size(-1), 0};  // row_stride: set by the innermost dimension of more than one
  for (std::int64_t i = t.dim() - 2; i >= 0; --i) {
    const std::int64_t size = t.size(i), stride = t.stride(i);
    if (size == 1) continue;
    if (b.batches == 1 && b.rows_per_batch == 1) {
      b.rows_per_batch = size, b.row_stride = stride;
    } else if (b.batches == 1 && stride == b.rows_per_batch * b.row_stride) {
      b.rows_per_batch *= size;
    } else if (b.batches == 1) {
      b.batches = size, b.batch_stride = stride;
    } else if (stride == b.batches * b.batch_stride) {
      b.batches *= size;
    } else {
      return std::nullopt;
    }
  }
  if (b.batches == 1) b.batch_stride = b.rows_per_batch * b.row_stride;
  return b;
}

// {rows, cols, stride} where the last dimension is contiguous and every other dimension folds into
// one evenly strided run of rows; nothing otherwise.
inline std::optional<StridedRows> strided_rows(const at::Tensor& t) {
  const auto b = strided_row_batches(t);
  if (!b || b->batches > 1) return std::nullopt;
  return StridedRows{b->rows_per_batch, b->cols, b->row_stride};
}

}  // namespace diffract::models
