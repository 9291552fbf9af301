// What a layer kind's float64 layer checks are written against (generators/kinds/<kind>/checks.h: a
// specialization KindChecks<Op::<kind>> with `static constexpr LayerCheck checks[]`): each check
// JIT-compiles the kind's Halide algorithm (algorithm.h) in float64 and compares it with a plain
// C++ reference and central finite differences (gradient_check.h); test_layers.cpp runs every
// kind's checks.
#pragma once

#include "gradient_check.h"

#include <cmath>
#include <functional>
#include <string>
import remat.language;

namespace remat::testing {

struct LayerCheck {
  const char *name;
  void (*run)();
};
// A check written as a Fixture with a run(): LayerCheck{"name", run_check<MyCheck>}.
template <class Check>
void run_check() {
  Check check;
  check.run();
}

template <Op op>
struct KindChecks {};

// An elementwise activation's checks (an algorithm with forward(name, x) and grad(name, x, dy), as
// gen::Relu): its forward against f(x) and its rule against dy * df(x) in plain C++, within
// `forward` and `rule`, and the rule against central finite differences (2e-9), on a [7, 4] input
// in (-3, 3) kept 1e-3 away from 0 (where ReLU has no derivative and relu2 no second one).
template <class Algorithm>
struct ActivationCheck : Fixture {
  void check(const std::string &name, const std::function<double(double)> &f, const std::function<double(double)> &df,
             Tolerance forward, Tolerance rule) {
    check(name, f, df, forward, rule, Algorithm(L));
  }
  void check(const std::string &name, const std::function<double(double)> &f, const std::function<double(double)> &df,
             Tolerance forward, Tolerance rule, const Algorithm &algorithm) {
    const int B = 4, C = 7;
    Buffer<double> x = random({C, B}, -3, 3), R = random({C, B});
    x.for_each_value([](double &a) {
      if (std::abs(a) < 1e-3) a = 0.5;
    });
    ImageParam xp = param(x, "x");
    Func y = algorithm.forward(name, xp);
    Buffer<double> dx = algorithm.grad("d" + name, xp, wrap(R, "dy")).realize({C, B});
    check_fd(name + " fd", x, dx, [&] { return objective(y, R); }, {2e-9, 0});
    check_ref(name + " grad", dx, [&](const int *p) { return R(p) * df(x(p)); }, rule);
    const Buffer<double> yb = y.realize({C, B});
    check_ref(name + " forward", yb, [&](const int *p) { return f(x(p)); }, forward);
  }
};

}  // namespace remat::testing
