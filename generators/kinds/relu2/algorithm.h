// The relu2 kind's algorithm, max(x, 0)^2, and its vector-Jacobian rule dx = 2 max(x, 0) dy.
#pragma once

#include <Halide.h>

#include "layers.h"

#include <string>

namespace remat::gen {

struct Relu2 {
  explicit Relu2(const Layers &layers) : L(layers), v(layers.v) {}

  Halide::Func forward(const std::string &name, Halide::Func x) const {
    Halide::Func y(name);
    const Halide::Expr r = Halide::max(x(v.c, v.b), L.constant(0));
    y(v.c, v.b) = L.store(r * r);
    return y;
  }
  Halide::Func grad(const std::string &name, Halide::Func x, Halide::Func dy) const {
    Halide::Func dx(name);
    dx(v.c, v.b) = dy(v.c, v.b) * (L.constant(2) * Halide::max(x(v.c, v.b), L.constant(0)));
    return dx;
  }

  const Layers &L;
  Vars v;
};

}  // namespace remat::gen
