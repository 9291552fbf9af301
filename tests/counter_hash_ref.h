// The dropout counter hash of generators/kinds/dropout/algorithm.h, written out again in plain C++ (not
// through Halide Exprs), for tests that check masks independently.
#pragma once

#include <cmath>
#include <cstdint>

namespace remat::testing {

inline uint64_t mix64_ref(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}
inline bool keep_ref(uint64_t seed, uint64_t step, uint64_t block, uint64_t element, double p) {
  const uint64_t G = 0x9e3779b97f4a7c15ULL;
  uint64_t key = mix64_ref(seed + G);
  key = mix64_ref(key + (step + 1) * G);
  key = mix64_ref(key + (block + 1) * G);
  const uint64_t h = mix64_ref(key + (element + 1) * G);
  return (h >> 32) >= static_cast<uint64_t>(std::llround(p * 4294967296.0));
}

}  // namespace remat::testing
