// The relu kind's float64 layer checks (tests/kind_checks.h): the algorithm JIT-compiled in float64
// against std::max and central finite differences.
#pragma once

#include <Halide.h>

#include "kind_checks.h"
#include "kinds/relu/algorithm.h"

#include <algorithm>

namespace remat::testing {

struct ReluCheck : ActivationCheck<gen::Relu> {
  void run() {
    // seen: fd 4.6e-10; forward and rule 0 (selections)
    check("relu", [](double a) { return std::max(a, 0.0); }, [](double a) { return a > 0 ? 1.0 : 0.0; }, exact, exact);
  }
};

template <>
struct KindChecks<Op::relu> {
  static constexpr LayerCheck checks[] = {{"relu", run_check<ReluCheck>}};
};

}  // namespace remat::testing
