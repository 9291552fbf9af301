// The rope kind's float64 reference for the tests (tests/kind_reference.h): the rotate-half rotation of each q and k
// head by t 10000^(-2i/D); v passes.
#pragma once

#include "kind_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace remat::testing {

template <>
struct KindReference<Op::rope> {
  static Rows rotate(LayerSite &r, const Layer &l, const Rows &x, double direction) {
    const int W = l.out, D = W / (l.heads + 2 * l.kv_heads), half = D / 2, rotated = (l.heads + l.kv_heads) * D;
    Rows y = x;
    for (long b = 0; b < r.rows; ++b)
      for (int c = 0; c < rotated; c += D)
        for (int i = 0; i < half; ++i) {
          const double angle = direction * double(b % l.block_size) * std::pow(l.rope_theta, -2.0 * i / D);
          const double lo = x[b * W + c + i], hi = x[b * W + c + i + half];
          y[b * W + c + i] = lo * std::cos(angle) - hi * std::sin(angle);
          y[b * W + c + i + half] = hi * std::cos(angle) + lo * std::sin(angle);
        }
    return y;
  }
  static Rows forward(LayerSite &r, const Layer &l, const Rows &x, Saved &) { return rotate(r, l, x, 1); }
  static Rows backward(LayerSite &r, const Layer &l, const Saved &, const Rows &dy) { return rotate(r, l, dy, -1); }
};

}  // namespace remat::testing
