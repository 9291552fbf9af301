// The swiglu kind's float64 reference for the tests (tests/kind_reference.h): [a | b] (2H) -> a sigmoid(a) b (H).
#pragma once

#include "kind_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace remat::testing {

template <>
struct KindReference<Op::swiglu> {
  static double sigmoid(double a) { return 1 / (1 + std::exp(-a)); }
  static Rows forward(LayerSite &r, const Layer &l, const Rows &x, Saved &) {
    const int H = l.out;
    Rows y(std::size_t(r.rows) * H);
    for (long b = 0; b < r.rows; ++b)
      for (int c = 0; c < H; ++c) {
        const double a = x[b * 2 * H + c];
        y[b * H + c] = a * sigmoid(a) * x[b * 2 * H + H + c];
      }
    return y;
  }
  static Rows backward(LayerSite &r, const Layer &l, const Saved &s, const Rows &dy) {
    const int H = l.out;
    Rows dx(std::size_t(r.rows) * 2 * H);
    for (long b = 0; b < r.rows; ++b)
      for (int c = 0; c < H; ++c) {
        const double a = s.in[b * 2 * H + c], up = s.in[b * 2 * H + H + c], sg = sigmoid(a);
        dx[b * 2 * H + c] = dy[b * H + c] * up * (sg + a * sg * (1 - sg));
        dx[b * 2 * H + H + c] = dy[b * H + c] * a * sg;
      }
    return dx;
  }
};

}  // namespace remat::testing
