// The dropout kind's float64 reference for the tests (tests/kind_reference.h): the kernels' counter-hash mask, element
// c + O b.
#pragma once

#include "kind_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace remat::testing {

template <>
struct KindReference<Op::dropout> {
  static Rows apply(LayerSite &r, const Layer &l, const Rows &x) {
    const int O = l.out;
    Rows y(x.size());
    for (long b = 0; b < r.rows; ++b)
      for (int c = 0; c < O; ++c) y[b * O + c] = x[b * O + c] * r.keep(std::uint64_t(c) + std::uint64_t(O) * b);
    return y;
  }
  static Rows forward(LayerSite &r, const Layer &l, const Rows &x, Saved &) { return apply(r, l, x); }
  static Rows backward(LayerSite &r, const Layer &l, const Saved &, const Rows &dy) { return apply(r, l, dy); }
};

}  // namespace remat::testing
