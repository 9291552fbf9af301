// The swiglu kind's algorithm (gated MLP): [a | b] of 2H features in, silu(a) * b out (H), and its
// vector-Jacobian rule.
#pragma once

#include <Halide.h>

#include "layers.h"

#include <string>

namespace remat::gen {

struct Swiglu {
  explicit Swiglu(const Layers &layers) : L(layers), v(layers.v) {}

  Halide::Expr sigmoid(Halide::Expr z) const { return L.constant(1) / (L.constant(1) + Halide::exp(-z)); }
  Halide::Func forward(const std::string &name, Halide::Func x, int out) const {
    Halide::Func y(name);
    Halide::Expr a = x(v.c, v.b), b = x(v.c + out, v.b);
    y(v.c, v.b) = L.store(a * sigmoid(a) * b);
    return y;
  }
  // d/da = dy * b * sig(a) * (1 + a * (1 - sig(a))), d/db = dy * silu(a): the gradient of the
  // 2H-wide input, the gate's half first.
  Halide::Func grad(const std::string &name, Halide::Func x, Halide::Func dy, int out) const {
    using namespace Halide;
    Func dx(name);
    Expr c = v.c % out;  // the feature within its half
    Expr a = x(c, v.b), b = x(c + out, v.b), g = dy(c, v.b), sa = sigmoid(a);
    dx(v.c, v.b) = select(v.c < out, g * b * sa * (L.constant(1) + a * (L.constant(1) - sa)), g * a * sa);
    return dx;
  }

  const Layers &L;
  Vars v;
};

}  // namespace remat::gen
