// The gelu kind's algorithm (the tanh form, as GPT-2, or exact with erf) and its vector-Jacobian rule.
#pragma once

#include <Halide.h>

#include "layers.h"

#include <string>

namespace remat::gen {

struct Gelu {
  static constexpr double k0 = 0.7978845608028654;  // sqrt(2 / pi)
  static constexpr double k1 = 0.044715;

  // exact: 0.5 x (1 + erf(x / sqrt 2)); otherwise the tanh form
  explicit Gelu(const Layers &layers, bool exact = false) : L(layers), v(layers.v), exact(exact) {}

  // tanh(z) = 1 - 2 / (exp(2z) + 1): finite for every z and vectorizes through Halide's exp.
  Halide::Expr tanh_via_exp(Halide::Expr z) const {
    return L.constant(1) - L.constant(2) / (Halide::exp(L.constant(2) * z) + L.constant(1));
  }
  // Halide's erf (float32, within three bits of the last) in the kernels; libm's in float64 checks.
  Halide::Expr erf(Halide::Expr z) const {
    using namespace Halide::Internal;
    if (z.type() == Halide::Float(64)) return Call::make(z.type(), "erf", {z}, Call::PureExtern);
    return Halide::erf(z);
  }
  Halide::Func forward(const std::string &name, Halide::Func x) const {
    using namespace Halide;
    Func y(name);
    Expr a = x(v.c, v.b);
    const Expr inner =
        exact ? erf(a * L.constant(M_SQRT1_2)) : tanh_via_exp(L.constant(k0) * (a + L.constant(k1) * a * a * a));
    y(v.c, v.b) = L.store(L.constant(0.5) * a * (L.constant(1) + inner));
    return y;
  }
  Halide::Func grad(const std::string &name, Halide::Func x, Halide::Func dy) const {
    using namespace Halide;
    Func dx(name);
    Expr a = x(v.c, v.b);
    Expr slope;
    if (exact) {  // Phi(a) + a phi(a)
      slope = L.constant(0.5) * (L.constant(1) + erf(a * L.constant(M_SQRT1_2))) +
              a * exp(L.constant(-0.5) * a * a) * L.constant(0.5 * M_2_SQRTPI * M_SQRT1_2);
    } else {
      Expr th = tanh_via_exp(L.constant(k0) * (a + L.constant(k1) * a * a * a));
      slope = L.constant(0.5) * (L.constant(1) + th) + L.constant(0.5) * a * (L.constant(1) - th * th) *
                                                           L.constant(k0) *
                                                           (L.constant(1) + L.constant(3 * k1) * a * a);
    }
    dx(v.c, v.b) = dy(v.c, v.b) * slope;
    return dx;
  }

  const Layers &L;
  Vars v;
  bool exact;
};

}  // namespace remat::gen
