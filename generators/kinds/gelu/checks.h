// The gelu kind's float64 layer checks (tests/kind_checks.h): the algorithm JIT-compiled in float64
// against std::tanh and central finite differences. Tolerances as in tests/test_layers.cpp's
// header: each limit sits just above the worst error seen at these seeds ("seen").
#pragma once

#include <Halide.h>

#include "kind_checks.h"
#include "kinds/gelu/algorithm.h"

#include <cmath>

namespace remat::testing {

struct GeluCheck : ActivationCheck<gen::Gelu> {
  void run() {
    constexpr double k0 = gen::Gelu::k0, k1 = gen::Gelu::k1;
    // GELU against std::tanh (the kernel's exp-based tanh is exact up to rounding); its rule
    // against the derivative of 0.5 a (1 + tanh(k0 (a + k1 a^3))). Seen: fd 5.2e-10, forward
    // 1.5e-16, rule 7.3e-16.
    check(
        "gelu", [](double a) { return 0.5 * a * (1 + std::tanh(k0 * (a + k1 * a * a * a))); },
        [](double a) {
          const double t = std::tanh(k0 * (a + k1 * a * a * a));
          return 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * k0 * (1 + 3 * k1 * a * a);
        },
        {1e-15, 0}, {4e-15, 0});
    // exact GELU (libm's erf in float64) against std::erf; its rule Phi(a) + a phi(a)
    check(
        "gelu_exact", [](double a) { return 0.5 * a * (1 + std::erf(a / std::sqrt(2.0))); },
        [](double a) {
          return 0.5 * (1 + std::erf(a / std::sqrt(2.0))) + a * std::exp(-a * a / 2) / std::sqrt(2 * M_PI);
        },
        {1e-15, 0}, {4e-15, 0}, gen::Gelu(L, true));
  }
};

template <>
struct KindChecks<Op::gelu> {
  static constexpr LayerCheck checks[] = {{"gelu", run_check<GeluCheck>}};
};

}  // namespace remat::testing
