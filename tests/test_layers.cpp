// Every layer's vector-Jacobian rule (generators/layers.h, JIT-compiled in float64) against
// central finite differences and against a plain C++ reference.
//
// Tolerances. The objective is J = sum(y * R) for a fixed random R, so dJ/dy = R.
// - Finite differences in float64 with step h = 1e-6: truncation error is O(h^2 |J'''|) ~ 1e-12
//   and rounding error ~ 1e-16 |J| / h ~ 1e-10 for |J| ~ 1, so |fd - vjp| <= 1e-7 (1 + |vjp|)
//   leaves three orders of margin while still catching any wrong term (those are O(1e-1)).
// - The plain C++ reference computes the same formulas in float64 with other summation orders:
//   differences are rounding only, |ref - vjp| <= 1e-11 (1 + |vjp|).
#include <boost/test/unit_test.hpp>

#include <Halide.h>
#include <layers.h>

#include "gradient_check.h"

#include <cmath>
#include <functional>
#include <random>
#include <vector>

using namespace Halide;
using remat::gen::Layers;
using namespace remat::testing;

BOOST_FIXTURE_TEST_CASE(linear, Fixture) {
  const int B = 3, K = 5, O = 4;
  Buffer<double> x = random({K, B}), w = random({O, K}), bias = random({O}), R = random({O, B});
  ImageParam xp = param(x, "x"), wp = param(w, "w"), bp = param(bias, "b");
  Func y = L.linear("y", xp, wp, bp, K).out;
  Func dy = wrap(R, "dy");
  Buffer<double> dw = L.linear_weight_grad("dw", xp, dy, B).out.realize({O, K});
  Buffer<double> db = L.column_sum("db", dy, B).realize({O});
  Buffer<double> dx = L.linear_input_grad("dx", dy, L.transpose("wt", wp), O).out.realize({K, B});
  auto J = [&] { return objective(y, R); };
  check_fd("dx", x, dx, J);
  check_fd("dw", w, dw, J);
  check_fd("db", bias, db, J);
  check_ref("dx", dx, [&](const int *p) { double s = 0; for (int o = 0; o < O; ++o) s += R(o, p[1]) * w(o, p[0]); return s; });
  check_ref("dw", dw, [&](const int *p) { double s = 0; for (int b = 0; b < B; ++b) s += x(p[1], b) * R(p[0], b); return s; });
  check_ref("db", db, [&](const int *p) { double s = 0; for (int b = 0; b < B; ++b) s += R(p[0], b); return s; });
}

BOOST_FIXTURE_TEST_CASE(layer_norm, Fixture) {
  const int B = 3, C = 6;
  Buffer<double> x = random({C, B}), gamma = random({C}, 0.5, 1.5), beta = random({C}), R = random({C, B});
  ImageParam xp = param(x, "x"), gp = param(gamma, "gamma"), bp = param(beta, "beta");
  auto stats = L.layer_norm_stats("mean", "rstd", xp, C);
  Func y = L.layer_norm("y", xp, stats, gp, bp);
  Func dy = wrap(R, "dy");
  auto g = L.layer_norm_grad("s1", "s2", "dx", xp, stats, gp, dy, C, B);
  Buffer<double> dx = g.dx.realize({C, B}), dgamma = g.dgamma.realize({C}), dbeta = g.dbeta.realize({C});
  auto J = [&] { return objective(y, R); };
  check_fd("dx", x, dx, J);
  check_fd("dgamma", gamma, dgamma, J);
  check_fd("dbeta", beta, dbeta, J);
  // Reference: the textbook per-row formula with its own mean and variance.
  auto row = [&](int b) {
    double mean = 0, var = 0;
    for (int c = 0; c < C; ++c) mean += x(c, b) / C;
    for (int c = 0; c < C; ++c) var += (x(c, b) - mean) * (x(c, b) - mean) / C;
    return std::pair{mean, 1 / std::sqrt(var + Layers::layer_norm_eps)};
  };
  check_ref("dx", dx, [&](const int *p) {
    auto [mean, rstd] = row(p[1]);
    double a = 0, bsum = 0;
    for (int c = 0; c < C; ++c) {
      const double u = (x(c, p[1]) - mean) * rstd, du = R(c, p[1]) * gamma(c);
      a += du;
      bsum += du * u;
    }
    const double u = (x(p[0], p[1]) - mean) * rstd;
    return rstd * (R(p[0], p[1]) * gamma(p[0]) - a / C - u * bsum / C);
  });
  check_ref("dgamma", dgamma, [&](const int *p) {
    double s = 0;
    for (int b = 0; b < B; ++b) { auto [mean, rstd] = row(b); s += R(p[0], b) * (x(p[0], b) - mean) * rstd; }
    return s;
  });
}

BOOST_FIXTURE_TEST_CASE(gelu_and_relu, Fixture) {
  const int B = 4, C = 7;
  // ReLU is not differentiable at 0: keep inputs away from it by more than the FD step.
  Buffer<double> x = random({C, B}, -3, 3), R = random({C, B});
  x.for_each_value([](double &a) { if (std::abs(a) < 1e-3) a = 0.5; });
  ImageParam xp = param(x, "x");
  Func dy = wrap(R, "dy");
  Func gelu = L.gelu("gelu", xp), relu = L.relu("relu", xp);
  Buffer<double> dgelu = L.gelu_grad("dgelu", xp, dy).realize({C, B}), drelu = L.relu_grad("drelu", xp, dy).realize({C, B});
  check_fd("gelu", x, dgelu, [&] { return objective(gelu, R); });
  check_fd("relu", x, drelu, [&] { return objective(relu, R); });
  check_ref("gelu", dgelu, [&](const int *p) {  // derivative of 0.5 a (1 + tanh(k0 (a + k1 a^3)))
    const double a = x(p), t = std::tanh(Layers::gelu_k0 * (a + Layers::gelu_k1 * a * a * a));
    return R(p) * (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * Layers::gelu_k0 * (1 + 3 * Layers::gelu_k1 * a * a));
  });
  // GELU itself against std::tanh: the kernel's exp-based tanh is exact up to rounding.
  Buffer<double> y = gelu.realize({C, B});
  check_ref("gelu forward", y, [&](const int *p) {
    const double a = x(p);
    return 0.5 * a * (1 + std::tanh(Layers::gelu_k0 * (a + Layers::gelu_k1 * a * a * a)));
  });
}

BOOST_FIXTURE_TEST_CASE(cross_entropy, Fixture) {
  const int B = 4, K = 5;
  Buffer<double> logits = random({K, B}, -4, 4);
  Buffer<int> labels({B});
  for (int b = 0; b < B; ++b) labels(b) = b % K;
  ImageParam lp = param(logits, "logits");
  ImageParam yp(Int(32), 1, "labels");
  yp.set(labels);
  auto ce = L.cross_entropy(lp, yp, K, L.constant(1.0));
  Buffer<double> ones({B});
  ones.fill(1.0);
  Buffer<double> dl = ce.dlogits.realize({K, B});
  check_fd("dlogits", logits, dl, [&] { return objective(ce.row_loss, ones); });
  check_ref("dlogits", dl, [&](const int *p) {
    double z = 0;
    for (int k = 0; k < K; ++k) z += std::exp(logits(k, p[1]));
    return std::exp(logits(p[0], p[1])) / z - (p[0] == labels(p[1]) ? 1 : 0);
  });
}

BOOST_FIXTURE_TEST_CASE(adamw_step, Fixture) {
  const int N = 9;
  Buffer<double> p = random({N}), g = random({N}), m = random({N}), var = random({N}, 0, 1);
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1, c1 = 0.19, c2 = 0.002;
  Func upd = L.adamw(param(p, "p"), param(g, "g"), param(m, "m"), param(var, "v"), L.constant(lr),
                     L.constant(b1), L.constant(b2), L.constant(eps), L.constant(wd), L.constant(c1), L.constant(c2));
  Realization r = upd.realize({N});
  Buffer<double> p1 = r[0], m1 = r[1], v1 = r[2];
  for (int i = 0; i < N; ++i) {
    const double em = b1 * m(i) + (1 - b1) * g(i), ev = b2 * var(i) + (1 - b2) * g(i) * g(i);
    const double ep = p(i) - lr * ((em / c1) / (std::sqrt(ev / c2) + eps) + wd * p(i));
    BOOST_TEST(std::abs(m1(i) - em) <= ref_tol);
    BOOST_TEST(std::abs(v1(i) - ev) <= ref_tol);
    BOOST_TEST(std::abs(p1(i) - ep) <= ref_tol * (1 + std::abs(ep)));
  }
}
