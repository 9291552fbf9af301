// The relu2 kind's float64 layer checks (tests/kind_checks.h): the algorithm JIT-compiled in
// float64 against the formula in plain C++ and against central finite differences.
#pragma once

#include <Halide.h>

#include "kind_checks.h"
#include "kinds/relu2/algorithm.h"

#include <algorithm>

namespace remat::testing {

struct Relu2Check : ActivationCheck<gen::Relu2> {
  void run() {
    // the same multiplications on both sides: bit for bit (seen: fd 4.0e-10, forward and rule 0)
    check(
        "relu2", [](double a) { return std::max(a, 0.0) * std::max(a, 0.0); },
        [](double a) { return 2 * std::max(a, 0.0); }, exact, exact);
  }
};

template <>
struct KindChecks<Op::relu2> {
  static constexpr LayerCheck checks[] = {{"relu2", run_check<Relu2Check>}};
};

}  // namespace remat::testing
