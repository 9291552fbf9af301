// What a layer kind's float64 layer checks are written against (generators/kinds/<kind>/checks.h: a
// specialization KindChecks<Op::<kind>> with `static constexpr LayerCheck checks[]`): each check
// JIT-compiles the kind's Halide algorithm (algorithm.h) in float64 and compares it with a plain
// C++ reference and central finite differences (gradient_check.h); test_layers.cpp runs every
// kind's checks.
#pragma once

#include "gradient_check.h"
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

}  // namespace remat::testing
