// The gelu kind's float64 reference for the tests (tests/kind_reference.h): the tanh form, as GPT-2.
#pragma once

#include "kind_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace remat::testing {

template <>
struct KindReference<Op::gelu> {
  static constexpr double k0 = 0.7978845608028654, k1 = 0.044715;
  static Rows forward(LayerSite &, const Layer &, const Rows &x, Saved &) {
    Rows y(x.size());
    for (std::size_t e = 0; e < y.size(); ++e)
      y[e] = 0.5 * x[e] * (1 + std::tanh(k0 * (x[e] + k1 * x[e] * x[e] * x[e])));
    return y;
  }
  static Rows backward(LayerSite &, const Layer &, const Saved &s, const Rows &dy) {
    Rows dx(dy.size());
    for (std::size_t e = 0; e < dx.size(); ++e) {
      const double a = s.in[e], t = std::tanh(k0 * (a + k1 * a * a * a));
      dx[e] = dy[e] * (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * k0 * (1 + 3 * k1 * a * a));
    }
    return dx;
  }
};

}  // namespace remat::testing
