// The relu kind's algorithm, max(x, 0), and its vector-Jacobian rule.
#pragma once

#include <Halide.h>

#include "layers.h"

#include <string>

namespace remat::gen {

struct Relu {
  explicit Relu(const Layers &layers) : L(layers), v(layers.v) {}

  Halide::Func forward(const std::string &name, Halide::Func x) const {
    Halide::Func y(name);
    y(v.c, v.b) = L.store(Halide::max(x(v.c, v.b), L.constant(0)));
    return y;
  }
  Halide::Func grad(const std::string &name, Halide::Func x, Halide::Func dy) const {
    Halide::Func dx(name);
    dx(v.c, v.b) = Halide::select(x(v.c, v.b) > L.constant(0), dy(v.c, v.b), L.constant(0));
    return dx;
  }

  const Layers &L;
  Vars v;
};

}  // namespace remat::gen
