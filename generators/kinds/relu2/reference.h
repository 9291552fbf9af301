// The relu2 kind's float64 reference for the tests (tests/kind_reference.h): max(x, 0)^2.
#pragma once

#include "kind_reference.h"

#include <algorithm>
#include <vector>

namespace remat::testing {

template <>
struct KindReference<Op::relu2> {
  static Rows forward(LayerSite &, const Layer &, const Rows &x, Saved &) {
    Rows y(x.size());
    for (std::size_t e = 0; e < y.size(); ++e) y[e] = std::max(x[e], 0.0) * std::max(x[e], 0.0);
    return y;
  }
  static Rows backward(LayerSite &, const Layer &, const Saved &s, const Rows &dy) {
    Rows dx(dy.size());
    for (std::size_t e = 0; e < dx.size(); ++e) dx[e] = 2 * std::max(s.in[e], 0.0) * dy[e];
    return dx;
  }
};

}  // namespace remat::testing
