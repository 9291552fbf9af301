// The rms_norm kind's float64 layer checks (tests/kind_checks.h): the algorithm JIT-compiled in float64
// against a plain C++ reference and central finite differences. Tolerances as in tests/test_layers.cpp's
// header: each limit sits just above the worst error seen at these seeds ("seen").
#pragma once

#include <Halide.h>

#include "kind_checks.h"
#include "kinds/rms_norm/algorithm.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace remat::testing {

// Odd shapes (rows 5, width 7).
struct RmsNormCheck : Fixture {
  void run() {
    const int B = 5, C = 7;
    Buffer<double> x = random({C, B}), gamma = random({C}, 0.5, 1.5), R = random({C, B});
    ImageParam xp = param(x, "x"), gp = param(gamma, "gamma");
    auto stats = gen::RmsNorm(L).stats("rstd", xp, C);
    Func y = gen::RmsNorm(L).forward("y", xp, stats.rstd, gp);
    auto rstd_of = [&](int b) {  // textbook: 1 / sqrt(mean of squares + eps)
      double ms = 0;
      for (int c = 0; c < C; ++c) ms += x(c, b) * x(c, b) / C;
      return 1 / std::sqrt(ms + gen::RmsNorm::default_eps);
    };
    const Buffer<double> rstd = stats.rstd.realize({B}), yb = y.realize({C, B});
    check_ref("rms_norm rstd", rstd, [&](const int *p) { return rstd_of(p[0]); }, {1e-15, 0});  // seen 1.2e-16
    check_ref("rms_norm y", yb, [&](const int *p) { return x(p) * rstd_of(p[1]) * gamma(p[0]); },
              {1e-15, 0});  // seen 2.3e-16
    Func dy = wrap(R, "dy");
    auto g = gen::RmsNorm(L).grad("s", "dx", xp, stats.rstd, gp, dy, C, B);
    Buffer<double> dx = g.dx.realize({C, B}), dgamma = g.dgamma.realize({C});
    auto J = [&] { return objective(y, R); };
    check_fd("rms_norm dx fd", x, dx, J, {1e-9, 0});               // seen 4.9e-10
    check_fd("rms_norm dgamma fd", gamma, dgamma, J, {5e-10, 0});  // seen 3.2e-10
    check_ref("rms_norm dx", dx,
              [&](const int *p) {  // d/dx of x_c r g_c with r = (mean x^2 + eps)^-1/2
                const int b = p[1];
                const double r = rstd_of(b);
                double sum = 0;  // sum_c R_c g_c x_c
                for (int c = 0; c < C; ++c) sum += R(c, b) * gamma(c) * x(c, b);
                return R(p) * gamma(p[0]) * r - x(p) * r * r * r * sum / C;
              },
              {2e-15, 0});  // seen 2.0e-16
    check_ref("rms_norm dgamma", dgamma,
              [&](const int *p) {
                double s = 0;
                for (int b = 0; b < B; ++b) s += R(p[0], b) * x(p[0], b) * rstd_of(b);
                return s;
              },
              {1e-15, 0});  // seen 1.5e-16
  }
};

template <>
struct KindChecks<Op::rms_norm> {
  static constexpr LayerCheck checks[] = {{"rms_norm", run_check<RmsNormCheck>}};
};

}  // namespace remat::testing
