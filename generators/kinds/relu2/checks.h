// The relu2 kind's float64 layer checks (tests/kind_checks.h): the algorithm JIT-compiled in
// float64 against the formula in plain C++ and against central finite differences.
#pragma once

#include <Halide.h>

#include "kind_checks.h"
#include "kinds/relu2/algorithm.h"

#include <algorithm>
#include <cmath>

namespace remat::testing {

struct Relu2Check : Fixture {
  void run() {
    const int B = 4, C = 7;
    // the second derivative jumps at 0: keep inputs farther from it than the FD step
    Buffer<double> x = random({C, B}, -3, 3), R = random({C, B});
    x.for_each_value([](double &a) {
      if (std::abs(a) < 1e-3) a = 0.5;
    });
    ImageParam xp = param(x, "x");
    const gen::Relu2 relu2_of(L);
    Func y = relu2_of.forward("relu2", xp);
    Buffer<double> dx = relu2_of.grad("drelu2", xp, wrap(R, "dy")).realize({C, B});
    check_fd("relu2 fd", x, dx, [&] { return objective(y, R); }, {2e-9, 0});
    // the same multiplications on both sides: bit for bit
    check_ref("relu2 grad", dx, [&](const int *p) { return R(p) * (2 * std::max(x(p), 0.0)); }, exact);
    const Buffer<double> yb = y.realize({C, B});
    check_ref("relu2 forward", yb, [&](const int *p) { return std::max(x(p), 0.0) * std::max(x(p), 0.0); }, exact);
  }
};

template <>
struct KindChecks<Op::relu2> {
  static constexpr LayerCheck checks[] = {{"relu2", run_check<Relu2Check>}};
};

}  // namespace remat::testing
