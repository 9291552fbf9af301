// The rms_norm kind's algorithm (Llama's RMSNorm): y = x * rstd * gamma over the C features of
// each row, its row statistic and its vector-Jacobian rule.
#pragma once

#include <Halide.h>

#include "layers.h"

#include <string>

namespace remat::gen {

struct RmsNorm {
  // rstd(b) = 1 / sqrt(mean_c x^2 + eps); sq is the row sum it is made from (undefined when rstd
  // is read from a saved buffer).
  struct Stats {
    Halide::Func rstd, sq;
  };
  // du = dy * gamma, u = x * rstd; dx = rstd * (du - u * s / C) with the row sum s = sum_c du * u;
  // dgamma = sum_b dy * u.
  struct Grad {
    Halide::Func s, dx, dgamma;
  };

  static constexpr double default_eps = 1e-6;  // the checks'
  // eps: the layer's (remat::rms_norm(epsilon(e))).
  explicit RmsNorm(const Layers &layers, double eps = default_eps) : L(layers), v(layers.v), eps(eps) {}

  Stats stats(const std::string &rstd_name, Halide::Func x, int width) const {
    using namespace Halide;
    Stats s{Func(rstd_name), Func(part(rstd_name, "sq"))};
    RDom r(0, width, part(rstd_name, "r"));
    s.sq(v.b) = L.constant(0);
    s.sq(v.b) += x(r, v.b) * x(r, v.b);
    s.rstd(v.b) = L.constant(1) / sqrt(s.sq(v.b) / L.constant(width) + L.constant(eps));
    return s;
  }
  Halide::Func forward(const std::string &name, Halide::Func x, Halide::Func rstd, Halide::Func gamma) const {
    Halide::Func y(name);
    y(v.c, v.b) = L.store(x(v.c, v.b) * rstd(v.b) * gamma(v.c));
    return y;
  }
  Grad grad(const std::string &s_name, const std::string &dx_name, Halide::Func x, Halide::Func rstd,
            Halide::Func gamma, Halide::Func dy, int width, Halide::Expr batch) const {
    using namespace Halide;
    Grad g{Func(s_name), Func(dx_name), Func(part(dx_name, "dgamma"))};
    auto u = [&](Expr c, Expr b) { return x(c, b) * rstd(b); };
    auto du = [&](Expr c, Expr b) { return dy(c, b) * gamma(c); };
    RDom r(0, width, part(s_name, "r"));
    g.s(v.b) = L.constant(0);
    g.s(v.b) += du(r, v.b) * u(r, v.b);
    g.dx(v.c, v.b) = rstd(v.b) * (du(v.c, v.b) - u(v.c, v.b) * g.s(v.b) / L.constant(width));
    RDom rb(0, batch, part(dx_name, "rb"));
    g.dgamma(v.c) = L.constant(0);
    g.dgamma(v.c) += dy(v.c, rb) * u(v.c, rb);
    return g;
  }

  const Layers &L;
  Vars v;
  double eps;
};

}  // namespace remat::gen
