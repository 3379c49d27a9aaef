#pragma once
// The side of a square grid from its cell count, as the position-embedding tables of the DiTs
// store it ([1, side * side, D]). Exact in 64-bit integers, for any count a file can state.
#include <cmath>
#include <cstdint>
#include <optional>

namespace diffract {

// s with s * s == cells, or nothing where cells is not a positive perfect square (negative, zero,
// or between two squares).
inline std::optional<std::int64_t> square_side(std::int64_t cells) {
  if (cells <= 0) return std::nullopt;
  // The double's root is within one of the integer root for every positive int64.
  const auto guess = static_cast<std::int64_t>(std::sqrt(static_cast<double>(cells)));
  for (std::int64_t s = guess > 0 ? guess - 1 : 0; s <= guess + 1; ++s)
    if (static_cast<__int128>(s) * s == cells) return s;
  return std::nullopt;
}

}  // namespace diffract
