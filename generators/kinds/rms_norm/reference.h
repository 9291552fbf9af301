// The rms_norm kind's float64 reference for the tests (tests/kind_reference.h): x / sqrt(mean x^2 + 1e-6) * gamma over
// each row.
#pragma once

#include "kind_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace remat::testing {

template <>
struct KindReference<Op::rms_norm> {
  static Rows forward(LayerSite &r, const Layer &l, const Rows &x, Saved &s) {
    const int I = l.in;
    auto g = r.param(0);
    Rows y(x.size());
    for (long b = 0; b < r.rows; ++b) {
      double ms = 0;
      for (int i = 0; i < I; ++i) ms += x[b * I + i] * x[b * I + i] / I;
      s.rstd.push_back(1 / std::sqrt(ms + l.eps));
      for (int i = 0; i < I; ++i) y[b * I + i] = x[b * I + i] * s.rstd[b] * g[i];
    }
    return y;
  }
  // dx_i = rstd g_i dy_i - x_i rstd^3 / I sum_c dy_c g_c x_c; dgamma = sum_b dy x rstd
  static Rows backward(LayerSite &r, const Layer &l, const Saved &s, const Rows &dy) {
    const int I = l.in;
    const Rows &x = s.in;
    auto g = r.param(0);
    Rows dx(x.size()), dg(I, 0.0);
    for (long b = 0; b < r.rows; ++b) {
      const double rs = s.rstd[b];
      double sum = 0;
      for (int i = 0; i < I; ++i) {
        sum += dy[b * I + i] * g[i] * x[b * I + i];
        dg[i] += dy[b * I + i] * x[b * I + i] * rs;
      }
      for (int i = 0; i < I; ++i) dx[b * I + i] = rs * g[i] * dy[b * I + i] - x[b * I + i] * rs * rs * rs * sum / I;
    }
    r.put_grad(0, dg);
    return dx;
  }
};

}  // namespace remat::testing
