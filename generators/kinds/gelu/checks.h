// The gelu kind's float64 layer checks (tests/kind_checks.h): the algorithm JIT-compiled in float64
// against std::tanh and central finite differences. Tolerances as in tests/test_layers.cpp's
// header: each limit sits just above the worst error seen at these seeds ("seen").
#pragma once

#include <Halide.h>

#include "kind_checks.h"
#include "kinds/gelu/algorithm.h"

#include <cmath>

namespace remat::testing {

struct GeluCheck : Fixture {
  void run() {
    const int B = 4, C = 7;
    // the inputs of the relu check (the same draws)
    Buffer<double> x = random({C, B}, -3, 3), R = random({C, B});
    x.for_each_value([](double &a) {
      if (std::abs(a) < 1e-3) a = 0.5;
    });
    ImageParam xp = param(x, "x");
    Func dy = wrap(R, "dy");
    const gen::Gelu gelu_of(L);
    Func gelu = gelu_of.forward("gelu", xp);
    Buffer<double> dgelu = gelu_of.grad("dgelu", xp, dy).realize({C, B});
    check_fd("gelu fd", x, dgelu, [&] { return objective(gelu, R); }, {2e-9, 0});  // seen 5.2e-10
    check_ref("gelu grad", dgelu,
              [&](const int *p) {  // derivative of 0.5 a (1 + tanh(k0 (a + k1 a^3)))
                const double a = x(p), t = std::tanh(gen::Gelu::k0 * (a + gen::Gelu::k1 * a * a * a));
                return R(p) * (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * gen::Gelu::k0 * (1 + 3 * gen::Gelu::k1 * a * a));
              },
              {4e-15, 0});  // seen 7.3e-16
    // GELU itself against std::tanh: the kernel's exp-based tanh is exact up to rounding.
    const Buffer<double> y = gelu.realize({C, B});
    check_ref("gelu forward", y,
              [&](const int *p) {
                const double a = x(p);
                return 0.5 * a * (1 + std::tanh(gen::Gelu::k0 * (a + gen::Gelu::k1 * a * a * a)));
              },
              {1e-15, 0});  // seen 1.5e-16
  }
};

template <>
struct KindChecks<Op::gelu> {
  static constexpr LayerCheck checks[] = {{"gelu", run_check<GeluCheck>}};
};

}  // namespace remat::testing
