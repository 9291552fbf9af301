// The gelu kind's algorithm (tanh form, as GPT-2) and its vector-Jacobian rule.
#pragma once

#include <Halide.h>

#include "layers.h"

#include <string>

namespace remat::gen {

struct Gelu {
  static constexpr double k0 = 0.7978845608028654;  // sqrt(2 / pi)
  static constexpr double k1 = 0.044715;

  explicit Gelu(const Layers &layers) : L(layers), v(layers.v) {}

  // tanh(z) = 1 - 2 / (exp(2z) + 1): finite for every z and vectorizes through Halide's exp.
  Halide::Expr tanh_via_exp(Halide::Expr z) const {
    return L.constant(1) - L.constant(2) / (Halide::exp(L.constant(2) * z) + L.constant(1));
  }
  Halide::Func forward(const std::string &name, Halide::Func x) const {
    using namespace Halide;
    Func y(name);
    Expr a = x(v.c, v.b);
    y(v.c, v.b) = L.store(L.constant(0.5) * a *
                          (L.constant(1) + tanh_via_exp(L.constant(k0) * (a + L.constant(k1) * a * a * a))));
    return y;
  }
  Halide::Func grad(const std::string &name, Halide::Func x, Halide::Func dy) const {
    using namespace Halide;
    Func dx(name);
    Expr a = x(v.c, v.b);
    Expr th = tanh_via_exp(L.constant(k0) * (a + L.constant(k1) * a * a * a));
    Expr slope = L.constant(0.5) * (L.constant(1) + th) + L.constant(0.5) * a * (L.constant(1) - th * th) *
                                                              L.constant(k0) *
                                                              (L.constant(1) + L.constant(3 * k1) * a * a);
    dx(v.c, v.b) = dy(v.c, v.b) * slope;
    return dx;
  }

  const Layers &L;
  Vars v;
};

}  // namespace remat::gen
