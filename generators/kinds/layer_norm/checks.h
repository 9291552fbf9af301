// The layer_norm kind's float64 layer checks (tests/kind_checks.h): the algorithm JIT-compiled in float64
// against a plain C++ reference and central finite differences. Tolerances as in tests/test_layers.cpp's
// header: each limit sits just above the worst error seen at these seeds ("seen").
#pragma once

#include <Halide.h>

#include "kind_checks.h"
#include "kinds/layer_norm/algorithm.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace remat::testing {

// Odd shapes (rows 5, width 7).
struct LayerNormCheck : Fixture {
  void run() {
    const int B = 5, C = 7;
    Buffer<double> x = random({C, B}), gamma = random({C}, 0.5, 1.5), beta = random({C}), R = random({C, B});
    ImageParam xp = param(x, "x"), gp = param(gamma, "gamma"), bp = param(beta, "beta");
    auto stats = gen::LayerNorm(L).stats("mean", "rstd", xp, C);
    Func y = gen::LayerNorm(L).forward("y", xp, stats, gp, bp);
    // Reference: the textbook per-row mean and biased variance, rstd = 1 / sqrt(var + eps).
    auto row = [&](int b) {
      double mean = 0, var = 0;
      for (int c = 0; c < C; ++c) mean += x(c, b) / C;
      for (int c = 0; c < C; ++c) var += (x(c, b) - mean) * (x(c, b) - mean) / C;
      return std::pair{mean, 1 / std::sqrt(var + gen::LayerNorm::default_eps)};
    };
    const Buffer<double> mean = stats.mean.realize({B}), rstd = stats.rstd.realize({B}), yb = y.realize({C, B});
    check_ref("layer_norm mean", mean, [&](const int *p) { return row(p[0]).first; }, {1e-15, 0});   // seen 2.7e-16
    check_ref("layer_norm rstd", rstd, [&](const int *p) { return row(p[0]).second; }, {1e-15, 0});  // seen 1.2e-16
    check_ref("layer_norm y", yb,
              [&](const int *p) {
                auto [m, r] = row(p[1]);
                return (x(p) - m) * r * gamma(p[0]) + beta(p[0]);
              },
              {1e-15, 0});  // seen 2.0e-16
    Func dy = wrap(R, "dy");
    auto g = gen::LayerNorm(L).grad("s1", "s2", "dx", xp, stats, gp, dy, C, B);
    Buffer<double> dx = g.dx.realize({C, B}), dgamma = g.dgamma.realize({C}), dbeta = g.dbeta.realize({C});
    auto J = [&] { return objective(y, R); };
    check_fd("layer_norm dx fd", x, dx, J, {1e-9, 0});               // seen 1.6e-10
    check_fd("layer_norm dgamma fd", gamma, dgamma, J, {5e-10, 0});  // seen 8.7e-11
    check_fd("layer_norm dbeta fd", beta, dbeta, J, {5e-10, 0});     // seen 6.8e-11
    check_ref("layer_norm dx", dx,
              [&](const int *p) {
                auto [mean, rstd] = row(p[1]);
                double a = 0, bsum = 0;
                for (int c = 0; c < C; ++c) {
                  const double u = (x(c, p[1]) - mean) * rstd, du = R(c, p[1]) * gamma(c);
                  a += du;
                  bsum += du * u;
                }
                const double u = (x(p[0], p[1]) - mean) * rstd;
                return rstd * (R(p[0], p[1]) * gamma(p[0]) - a / C - u * bsum / C);
              },
              {1e-15, 0});  // seen 1.3e-16
    check_ref("layer_norm dgamma", dgamma,
              [&](const int *p) {
                double s = 0;
                for (int b = 0; b < B; ++b) {
                  auto [mean, rstd] = row(b);
                  s += R(p[0], b) * (x(p[0], b) - mean) * rstd;
                }
                return s;
              },
              {1e-15, 0});  // seen 2.8e-16
    // seen 0: the same additions in the same order on both sides
    check_ref(
        "layer_norm dbeta", dbeta,
        [&](const int *p) {
          double s = 0;
          for (int b = 0; b < B; ++b) s += R(p[0], b);
          return s;
        },
        exact);
  }
};

template <>
struct KindChecks<Op::layer_norm> {
  static constexpr LayerCheck checks[] = {{"layer_norm", run_check<LayerNormCheck>}};
};

}  // namespace remat::testing
