// The relu kind's float64 reference for the tests (tests/kind_reference.h): max(x, 0).
#pragma once

#include "kind_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace remat::testing {

template <>
struct KindReference<Op::relu> {
  static Rows forward(LayerSite &, const Layer &, const Rows &x, Saved &) {
    Rows y(x.size());
    for (std::size_t e = 0; e < y.size(); ++e) y[e] = std::max(x[e], 0.0);
    return y;
  }
  static Rows backward(LayerSite &, const Layer &, const Saved &s, const Rows &dy) {
    Rows dx(dy.size());
    for (std::size_t e = 0; e < dx.size(); ++e) dx[e] = s.in[e] > 0 ? dy[e] : 0;
    return dx;
  }
};

}  // namespace remat::testing
