#pragma once
// The ATen side of our CUDA kernels: the kernels' element type for an ATen scalar type.
#include <optional>

#include <c10/core/ScalarType.h>

#include "core/models/common/group_norm_kernels.h"  // kernels::DType

namespace diffract::models {

// Float, Half and BFloat16; nothing for any other type (the caller falls back to ATen).
inline std::optional<kernels::DType> kernel_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return kernels::DType::Float;
    case c10::ScalarType::Half: return kernels::DType::Half;
    case c10::ScalarType::BFloat16: return kernels::DType::BFloat16;
    default: return std::nullopt;
  }
}

}  // namespace diffract::models
