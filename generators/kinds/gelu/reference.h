// The gelu kind's float64 reference for the tests (tests/kind_reference.h): the tanh form, as GPT-2,
// or exact (std::erf).
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
  static Rows forward(LayerSite &, const Layer &l, const Rows &x, Saved &) {
    Rows y(x.size());
    for (std::size_t e = 0; e < y.size(); ++e) {
      const double a = x[e];
      y[e] = 0.5 * a * (1 + (l.gelu_exact ? std::erf(a / std::sqrt(2.0)) : std::tanh(k0 * (a + k1 * a * a * a))));
    }
    return y;
  }
  static Rows backward(LayerSite &, const Layer &l, const Saved &s, const Rows &dy) {
    Rows dx(dy.size());
    for (std::size_t e = 0; e < dx.size(); ++e) {
      const double a = s.in[e], t = std::tanh(k0 * (a + k1 * a * a * a));
      const double slope =
          l.gelu_exact ? 0.5 * (1 + std::erf(a / std::sqrt(2.0))) + a * std::exp(-0.5 * a * a) / std::sqrt(2 * M_PI)
                       : 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * k0 * (1 + 3 * k1 * a * a);
      dx[e] = dy[e] * slope;
    }
    return dx;
  }
};

}  // namespace remat::testing
