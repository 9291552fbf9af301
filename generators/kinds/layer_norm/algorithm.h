// The layer_norm kind's algorithm: y = (x - mean) * rstd * gamma + beta over the C features of
// each row, its row statistics and its vector-Jacobian rule.
#pragma once

#include <Halide.h>

#include "layers.h"

#include <string>

namespace remat::gen {

struct LayerNorm {
  // Row statistics: mean(b) and rstd(b) = 1 / sqrt(var(b) + eps); sum and sq are the row sums
  // they are made from (undefined when the statistics are read from saved buffers).
  struct Stats {
    Halide::Func mean, rstd, sum, sq;
  };
  // du = dy * gamma; dx = rstd * (du - s1 / C - u * s2 / C) with u the normalized input and the
  // row sums s1 = sum_c du, s2 = sum_c du * u; dgamma = sum_b dy * u, dbeta = sum_b dy.
  struct Grad {
    Halide::Func s1, s2, dx, dgamma, dbeta;
  };

  static constexpr double default_eps = 1e-5;  // the checks'
  // eps: the layer's (remat::layer_norm(epsilon(e))).
  explicit LayerNorm(const Layers &layers, double eps = default_eps) : L(layers), v(layers.v), eps(eps) {}

  Stats stats(const std::string &mean_name, const std::string &rstd_name, Halide::Func x, int width) const {
    using namespace Halide;
    Stats s{Func(mean_name), Func(rstd_name), Func(part(mean_name, "sum")), Func(part(rstd_name, "sq"))};
    RDom r(0, width, part(mean_name, "r"));
    s.sum(v.b) = L.constant(0);
    s.sum(v.b) += x(r, v.b);
    s.mean(v.b) = s.sum(v.b) / L.constant(width);
    s.sq(v.b) = L.constant(0);
    s.sq(v.b) += (x(r, v.b) - s.mean(v.b)) * (x(r, v.b) - s.mean(v.b));
    s.rstd(v.b) = L.constant(1) / sqrt(s.sq(v.b) / L.constant(width) + L.constant(eps));
    return s;
  }
  Halide::Expr normalized(Halide::Func x, const Stats &s, Halide::Expr c, Halide::Expr b) const {
    return (x(c, b) - s.mean(b)) * s.rstd(b);
  }
  Halide::Func forward(const std::string &name, Halide::Func x, const Stats &s, Halide::Func gamma,
                       Halide::Func beta) const {
    Halide::Func y(name);
    y(v.c, v.b) = L.store(normalized(x, s, v.c, v.b) * gamma(v.c) + beta(v.c));
    return y;
  }
  Grad grad(const std::string &s1_name, const std::string &s2_name, const std::string &dx_name, Halide::Func x,
            const Stats &s, Halide::Func gamma, Halide::Func dy, int width, Halide::Expr batch) const {
    using namespace Halide;
    Grad g{Func(s1_name), Func(s2_name), Func(dx_name), Func(part(dx_name, "dgamma")), Func(part(dx_name, "dbeta"))};
    auto u = [&](Expr c, Expr b) { return normalized(x, s, c, b); };
    auto du = [&](Expr c, Expr b) { return dy(c, b) * gamma(c); };
    RDom r(0, width, part(s1_name, "r"));
    g.s1(v.b) = L.constant(0);
    g.s1(v.b) += du(r, v.b);
    g.s2(v.b) = L.constant(0);
    g.s2(v.b) += du(r, v.b) * u(r, v.b);
    g.dx(v.c, v.b) =
        s.rstd(v.b) * (du(v.c, v.b) - g.s1(v.b) / L.constant(width) - u(v.c, v.b) * g.s2(v.b) / L.constant(width));
    RDom rb(0, batch, part(dx_name, "rb"));
    g.dgamma(v.c) = L.constant(0);
    g.dgamma(v.c) += dy(v.c, rb) * u(v.c, rb);
    g.dbeta(v.c) = L.constant(0);
    g.dbeta(v.c) += dy(v.c, rb);
    return g;
  }

  const Layers &L;
  Vars v;
  double eps;
};

}  // namespace remat::gen
