// The linear kind's float64 reference for the tests (tests/kind_reference.h): y = x w (+ b), w [K, O] row-major.
#pragma once

#include "kind_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace remat::testing {

template <>
struct KindReference<Op::linear> {
  static Rows forward(LayerSite &r, const Layer &l, const Rows &x, Saved &) {
    const int I = l.in, O = l.out;
    auto w = r.param(0);
    const std::vector<double> bias = l.bias ? r.param(1) : std::vector<double>(O, 0.0);
    Rows y(std::size_t(r.rows) * O);
    for (long b = 0; b < r.rows; ++b)
      for (int o = 0; o < O; ++o) {
        double acc = bias[o];
        for (int i = 0; i < I; ++i) acc += x[b * I + i] * w[i * O + o];
        y[b * O + o] = acc;
      }
    return y;
  }
  static Rows backward(LayerSite &r, const Layer &l, const Saved &s, const Rows &dy) {
    const int I = l.in, O = l.out;
    auto w = r.param(0);
    Rows dx(std::size_t(r.rows) * I, 0.0), dw(std::size_t(I) * O, 0.0), db(O, 0.0);
    for (long b = 0; b < r.rows; ++b)
      for (int o = 0; o < O; ++o) {
        db[o] += dy[b * O + o];
        for (int i = 0; i < I; ++i) {
          dw[i * O + o] += s.in[b * I + i] * dy[b * O + o];
          dx[b * I + i] += dy[b * O + o] * w[i * O + o];
        }
      }
    r.put_grad(0, dw);
    if (l.bias) r.put_grad(1, db);
    return dx;
  }
};

}  // namespace remat::testing
