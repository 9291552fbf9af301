// Rows of sequences, for the kinds that see them (attention, rope, embedding): row b = n * T + t
// (n the sequence in the batch, t its position, T the block size, a compile-time int); the number
// of sequences N = rows / T is dynamic.
#pragma once

#include <Halide.h>

#include "layers.h"

#include <stdexcept>

namespace remat::gen {

struct Sequences {
  // block_size: T, the sequence length; rows are n * T + t.
  Sequences(const Layers &layers, int block_size) : L(layers), v(layers.v), T(block_size) {
    if (T < 1) throw std::invalid_argument("remat: block size must be >= 1");
  }
  Layers L;
  Vars v;
  int T;
};

}  // namespace remat::gen
