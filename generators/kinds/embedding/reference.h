// The embedding kind's float64 reference for the tests (tests/kind_reference.h): token table + position table (none
// under rope); reads the token ids, no input gradient.
#pragma once

#include "kind_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace remat::testing {

template <>
struct KindReference<Op::embedding> {
  static Rows forward(LayerSite &r, const Layer &l, const Rows &, Saved &s) {
    const int O = l.out;
    auto wte = r.param(0);
    const std::vector<double> wpe = l.bias ? r.param(1) : std::vector<double>(std::size_t(l.block_size) * O, 0.0);
    s.tokens = r.tokens();
    Rows y(std::size_t(r.rows) * O);
    for (long b = 0; b < r.rows; ++b)
      for (int c = 0; c < O; ++c) y[b * O + c] = wte[s.tokens[b] * O + c] + wpe[(b % l.block_size) * O + c];
    return y;
  }
  static Rows backward(LayerSite &r, const Layer &l, const Saved &s, const Rows &dy) {
    const int O = l.out;
    Rows dwte(std::size_t(l.vocab) * O, 0.0), dwpe(std::size_t(l.block_size) * O, 0.0);
    for (long b = 0; b < r.rows; ++b)
      for (int c = 0; c < O; ++c) {
        dwte[s.tokens[b] * O + c] += dy[b * O + c];
        dwpe[(b % l.block_size) * O + c] += dy[b * O + c];
      }
    r.put_grad(0, dwte);
    if (l.bias) r.put_grad(1, dwpe);
    return {};
  }
};

}  // namespace remat::testing
