// The layer_norm kind's float64 reference for the tests (tests/kind_reference.h): (x - mean) * rstd * gamma + beta over
// each row.
#pragma once

#include "kind_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace remat::testing {

template <>
struct KindReference<Op::layer_norm> {
  static Rows forward(LayerSite &r, const Layer &l, const Rows &x, Saved &s) {
    const int I = l.in;
    auto g = r.param(0), be = r.param(1);
    Rows y(x.size());
    for (long b = 0; b < r.rows; ++b) {
      double mean = 0, var = 0;
      for (int i = 0; i < I; ++i) mean += x[b * I + i] / I;
      for (int i = 0; i < I; ++i) var += (x[b * I + i] - mean) * (x[b * I + i] - mean) / I;
      const double rstd = 1 / std::sqrt(var + l.eps);
      s.mean.push_back(mean);
      s.rstd.push_back(rstd);
      for (int i = 0; i < I; ++i) y[b * I + i] = (x[b * I + i] - mean) * rstd * g[i] + be[i];
    }
    return y;
  }
  static Rows backward(LayerSite &r, const Layer &l, const Saved &s, const Rows &dy) {
    const int I = l.in;
    const Rows &x = s.in;
    auto g = r.param(0);
    Rows dx(x.size()), dg(I, 0.0), dbeta(I, 0.0);
    for (long b = 0; b < r.rows; ++b) {
      double s1 = 0, s2 = 0;
      for (int i = 0; i < I; ++i) {
        const double u = (x[b * I + i] - s.mean[b]) * s.rstd[b], du = dy[b * I + i] * g[i];
        s1 += du;
        s2 += du * u;
        dg[i] += dy[b * I + i] * u;
        dbeta[i] += dy[b * I + i];
      }
      for (int i = 0; i < I; ++i) {
        const double u = (x[b * I + i] - s.mean[b]) * s.rstd[b];
        dx[b * I + i] = s.rstd[b] * (dy[b * I + i] * g[i] - s1 / I - u * s2 / I);
      }
    }
    r.put_grad(0, dg);
    r.put_grad(1, dbeta);
    return dx;
  }
};

}  // namespace remat::testing
