// bfloat16 <-> float on the host, rounding as the kernels do (gen::to_bf16_bits in
// generators/layers.h): to nearest even, NaN to the quiet NaN 0x7fc0. bf16 is its bit pattern.
#pragma once

#include <cstdint>
#include <cstring>

namespace remat {

inline std::uint16_t float_to_bf16(float x) {
  if (x != x) return 0x7fc0;
  std::uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return std::uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float bf16_to_float(std::uint16_t h) {
  const std::uint32_t bits = std::uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

}  // namespace remat
