// The linear kind's float64 layer checks (tests/kind_checks.h): the algorithm JIT-compiled in float64
// against plain loops and central finite differences. Tolerances as in tests/test_layers.cpp's
// header: each limit sits just above the worst error seen at these seeds ("seen").
#pragma once

#include <Halide.h>

#include "kind_checks.h"
#include "kinds/linear/algorithm.h"

namespace remat::testing {

// y(o, b) = sum_k x(k, b) w(o, k) + bias(o), plain loops.
inline Halide::Buffer<double> linear_ref(const Halide::Buffer<double> &x, const Halide::Buffer<double> &w,
                                         const Halide::Buffer<double> &bias) {
  const int K = x.dim(0).extent(), B = x.dim(1).extent(), O = w.dim(0).extent();
  Halide::Buffer<double> y(O, B);
  for (int b = 0; b < B; ++b)
    for (int o = 0; o < O; ++o) {
      double s = bias(o);
      for (int k = 0; k < K; ++k) s += x(k, b) * w(o, k);
      y(o, b) = s;
    }
  return y;
}
// Shared with test_layers.cpp's checks_detect_errors, which must see these very limits fail.
inline constexpr Tolerance linear_y_tol{5e-16, 0},  // seen 9.4e-17 of scale (linear), 2.1e-16 (checks_detect_errors)
    linear_dx_fd_tol{1e-9, 0};                      // seen 1.2e-10

// Odd shapes (rows 5, in 7, out 3): no extent is a multiple of a vector width.
struct LinearCheck : Fixture {
  void run() {
    const int B = 5, K = 7, O = 3;
    Buffer<double> x = random({K, B}), w = random({O, K}), bias = random({O}), R = random({O, B});
    ImageParam xp = param(x, "x"), wp = param(w, "w"), bp = param(bias, "b");
    Func y = gen::linear(L, "y", xp, wp, bp, K).out;
    const Buffer<double> yb = y.realize({O, B}), expect_y = linear_ref(x, w, bias);
    check_ref("linear y", yb, [&](const int *p) { return expect_y(p); }, linear_y_tol);
    Func dy = wrap(R, "dy");
    Buffer<double> dw = gen::linear_weight_grad(L, "dw", xp, dy, B).out.realize({O, K});
    Buffer<double> db = L.column_sum("db", dy, B).realize({O});
    Buffer<double> dx = gen::linear_input_grad(L, "dx", dy, L.transpose("wt", wp), O).out.realize({K, B});
    auto J = [&] { return objective(y, R); };
    check_fd("linear dx fd", x, dx, J, linear_dx_fd_tol);
    check_fd("linear dw fd", w, dw, J, {5e-10, 0});    // seen 7.4e-11
    check_fd("linear db fd", bias, db, J, {1e-9, 0});  // seen 1.9e-10
    check_ref("linear dx", dx,
              [&](const int *p) {
                double s = 0;
                for (int o = 0; o < O; ++o) s += R(o, p[1]) * w(o, p[0]);
                return s;
              },
              {1e-15, 0});  // seen 1.3e-16
    check_ref("linear dw", dw,
              [&](const int *p) {
                double s = 0;
                for (int b = 0; b < B; ++b) s += x(p[1], b) * R(p[0], b);
                return s;
              },
              {5e-16, 0});  // seen 8.3e-17
    // seen 0: the same additions in the same order on both sides
    check_ref(
        "linear db", db,
        [&](const int *p) {
          double s = 0;
          for (int b = 0; b < B; ++b) s += R(p[0], b);
          return s;
        },
        exact);
  }
};

template <>
struct KindChecks<Op::linear> {
  static constexpr LayerCheck checks[] = {{"linear", run_check<LinearCheck>}};
};

}  // namespace remat::testing
