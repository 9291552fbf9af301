// The relu kind's float64 layer checks (tests/kind_checks.h): the algorithm JIT-compiled in float64
// against std::max and central finite differences.
#pragma once

#include <Halide.h>

#include "kind_checks.h"
#include "kinds/relu/algorithm.h"

#include <algorithm>
#include <cmath>

namespace remat::testing {

struct ReluCheck : Fixture {
  void run() {
    const int B = 4, C = 7;
    // ReLU is not differentiable at 0: keep inputs away from it by more than the FD step.
    Buffer<double> x = random({C, B}, -3, 3), R = random({C, B});
    x.for_each_value([](double &a) {
      if (std::abs(a) < 1e-3) a = 0.5;
    });
    ImageParam xp = param(x, "x");
    Func dy = wrap(R, "dy");
    const gen::Relu relu_of(L);
    Func relu = relu_of.forward("relu", xp);
    Buffer<double> drelu = relu_of.grad("drelu", xp, dy).realize({C, B});
    check_fd("relu fd", x, drelu, [&] { return objective(relu, R); }, {2e-9, 0});               // seen 4.6e-10
    check_ref("relu grad", drelu, [&](const int *p) { return x(p) > 0 ? R(p) : 0.0; }, exact);  // seen 0: a selection
    const Buffer<double> yr = relu.realize({C, B});
    check_ref("relu forward", yr, [&](const int *p) { return std::max(x(p), 0.0); }, exact);  // seen 0: a selection
  }
};

template <>
struct KindChecks<Op::relu> {
  static constexpr LayerCheck checks[] = {{"relu", run_check<ReluCheck>}};
};

}  // namespace remat::testing
