// The swiglu kind's float64 layer checks (tests/kind_checks.h): the algorithm JIT-compiled in float64
// against a plain C++ reference and central finite differences. Tolerances as in tests/test_layers.cpp's
// header: each limit sits just above the worst error seen at these seeds ("seen").
#pragma once

#include <Halide.h>

#include "kind_checks.h"
#include "kinds/swiglu/algorithm.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace remat::testing {

// SwiGLU on 2H = 2 x 5 features: [a | b] -> silu(a) * b.
struct SwigluCheck : Fixture {
  void run() {
    const int B = 4, H = 5;
    Buffer<double> x = random({2 * H, B}, -3, 3), R = random({H, B});
    ImageParam xp = param(x, "x");
    Func y = gen::Swiglu(L).forward("y", xp, H);
    auto silu = [](double a) { return a / (1 + std::exp(-a)); };
    const Buffer<double> yb = y.realize({H, B});
    check_ref("swiglu y", yb, [&](const int *p) { return silu(x(p[0], p[1])) * x(p[0] + H, p[1]); },
              {1e-15, 0});  // seen 1.2e-16
    Buffer<double> dx = gen::Swiglu(L).grad("dx", xp, wrap(R, "dy"), H).realize({2 * H, B});
    check_fd("swiglu dx fd", x, dx, [&] { return objective(y, R); }, {2e-9, 0});  // seen 3.2e-10
    check_ref("swiglu dx", dx,
              [&](const int *p) {
                const int c = p[0] % H, b = p[1];
                const double a = x(c, b), up = x(c + H, b), s = 1 / (1 + std::exp(-a));
                return p[0] < H ? R(c, b) * up * (s + a * s * (1 - s)) : R(c, b) * silu(a);
              },
              {2e-15, 0});  // seen 8.3e-17
  }
};

template <>
struct KindChecks<Op::swiglu> {
  static constexpr LayerCheck checks[] = {{"swiglu", run_check<SwigluCheck>}};
};

}  // namespace remat::testing
