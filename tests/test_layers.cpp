// Every layer's forward and vector-Jacobian rule (generators/layers.h, JIT-compiled in float64)
// against a plain C++ reference and, for the rules, against central finite differences.
//
// Tolerances (compare.h: atol times the tensor's largest reference magnitude; NaN fails). The
// objective is J = sum(y * R) for a fixed random R, so dJ/dy = R. Each limit sits just above
// the worst error observed at these fixed seeds, stated beside it as "seen": an error past it
// is a change in the numerics, not noise. A wrong term is an O(1e-1) error.
// - Finite differences in float64 with step h = 1e-6: truncation O(h^2 |J'''|) ~ 1e-12 and
//   rounding ~ 1e-16 |J| / h ~ 1e-10 for |J| ~ 1.
// - The plain C++ reference computes the same formulas in float64 with other summation orders:
//   differences are rounding only, a few ulps (2.2e-16) of the scale.
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

namespace {

// y(o, b) = sum_k x(k, b) w(o, k) + bias(o), plain loops.
Buffer<double> linear_ref(const Buffer<double> &x, const Buffer<double> &w, const Buffer<double> &bias) {
  const int K = x.dim(0).extent(), B = x.dim(1).extent(), O = w.dim(0).extent();
  Buffer<double> y(O, B);
  for (int b = 0; b < B; ++b)
    for (int o = 0; o < O; ++o) {
      double s = bias(o);
      for (int k = 0; k < K; ++k) s += x(k, b) * w(o, k);
      y(o, b) = s;
    }
  return y;
}
// Shared with checks_detect_errors, which must see these very limits fail.
constexpr Tolerance linear_y_tol{5e-16, 0},  // seen 9.4e-17 of scale (linear), 2.1e-16 (checks_detect_errors)
    linear_dx_fd_tol{1e-9, 0};               // seen 1.2e-10

}  // namespace

// Odd shapes (rows 5, in 7, out 3): no extent is a multiple of a vector width.
BOOST_FIXTURE_TEST_CASE(linear, Fixture) {
  const int B = 5, K = 7, O = 3;
  Buffer<double> x = random({K, B}), w = random({O, K}), bias = random({O}), R = random({O, B});
  ImageParam xp = param(x, "x"), wp = param(w, "w"), bp = param(bias, "b");
  Func y = L.linear("y", xp, wp, bp, K).out;
  const Buffer<double> yb = y.realize({O, B}), expect_y = linear_ref(x, w, bias);
  check_ref("linear y", yb, [&](const int *p) { return expect_y(p); }, linear_y_tol);
  Func dy = wrap(R, "dy");
  Buffer<double> dw = L.linear_weight_grad("dw", xp, dy, B).out.realize({O, K});
  Buffer<double> db = L.column_sum("db", dy, B).realize({O});
  Buffer<double> dx = L.linear_input_grad("dx", dy, L.transpose("wt", wp), O).out.realize({K, B});
  auto J = [&] { return objective(y, R); };
  check_fd("linear dx fd", x, dx, J, linear_dx_fd_tol);
  check_fd("linear dw fd", w, dw, J, {5e-10, 0});    // seen 7.4e-11
  check_fd("linear db fd", bias, db, J, {1e-9, 0});  // seen 1.9e-10
  check_ref("linear dx", dx,
            [&](const int *p) {
              double s = 0;
              for (int o = 0; o < O; ++o) s += R(o, p[1]) * w(o, p[0]);
              return s;
            },
            {1e-15, 0});  // seen 1.3e-16
  check_ref("linear dw", dw,
            [&](const int *p) {
              double s = 0;
              for (int b = 0; b < B; ++b) s += x(p[1], b) * R(p[0], b);
              return s;
            },
            {5e-16, 0});  // seen 8.3e-17
  // seen 0: the same additions in the same order on both sides
  check_ref(
      "linear db", db,
      [&](const int *p) {
        double s = 0;
        for (int b = 0; b < B; ++b) s += R(p[0], b);
        return s;
      },
      exact);
}

// Odd shapes (rows 5, width 7).
BOOST_FIXTURE_TEST_CASE(layer_norm, Fixture) {
  const int B = 5, C = 7;
  Buffer<double> x = random({C, B}), gamma = random({C}, 0.5, 1.5), beta = random({C}), R = random({C, B});
  ImageParam xp = param(x, "x"), gp = param(gamma, "gamma"), bp = param(beta, "beta");
  auto stats = L.layer_norm_stats("mean", "rstd", xp, C);
  Func y = L.layer_norm("y", xp, stats, gp, bp);
  // Reference: the textbook per-row mean and biased variance, rstd = 1 / sqrt(var + eps).
  auto row = [&](int b) {
    double mean = 0, var = 0;
    for (int c = 0; c < C; ++c) mean += x(c, b) / C;
    for (int c = 0; c < C; ++c) var += (x(c, b) - mean) * (x(c, b) - mean) / C;
    return std::pair{mean, 1 / std::sqrt(var + Layers::layer_norm_eps)};
  };
  const Buffer<double> mean = stats.mean.realize({B}), rstd = stats.rstd.realize({B}), yb = y.realize({C, B});
  check_ref("layer_norm mean", mean, [&](const int *p) { return row(p[0]).first; }, {1e-15, 0});   // seen 2.7e-16
  check_ref("layer_norm rstd", rstd, [&](const int *p) { return row(p[0]).second; }, {1e-15, 0});  // seen 1.2e-16
  check_ref("layer_norm y", yb,
            [&](const int *p) {
              auto [m, r] = row(p[1]);
              return (x(p) - m) * r * gamma(p[0]) + beta(p[0]);
            },
            {1e-15, 0});  // seen 2.0e-16
  Func dy = wrap(R, "dy");
  auto g = L.layer_norm_grad("s1", "s2", "dx", xp, stats, gp, dy, C, B);
  Buffer<double> dx = g.dx.realize({C, B}), dgamma = g.dgamma.realize({C}), dbeta = g.dbeta.realize({C});
  auto J = [&] { return objective(y, R); };
  check_fd("layer_norm dx fd", x, dx, J, {1e-9, 0});               // seen 1.6e-10
  check_fd("layer_norm dgamma fd", gamma, dgamma, J, {5e-10, 0});  // seen 8.7e-11
  check_fd("layer_norm dbeta fd", beta, dbeta, J, {5e-10, 0});     // seen 6.8e-11
  check_ref("layer_norm dx", dx,
            [&](const int *p) {
              auto [mean, rstd] = row(p[1]);
              double a = 0, bsum = 0;
              for (int c = 0; c < C; ++c) {
                const double u = (x(c, p[1]) - mean) * rstd, du = R(c, p[1]) * gamma(c);
                a += du;
                bsum += du * u;
              }
              const double u = (x(p[0], p[1]) - mean) * rstd;
              return rstd * (R(p[0], p[1]) * gamma(p[0]) - a / C - u * bsum / C);
            },
            {1e-15, 0});  // seen 1.3e-16
  check_ref("layer_norm dgamma", dgamma,
            [&](const int *p) {
              double s = 0;
              for (int b = 0; b < B; ++b) {
                auto [mean, rstd] = row(b);
                s += R(p[0], b) * (x(p[0], b) - mean) * rstd;
              }
              return s;
            },
            {1e-15, 0});  // seen 2.8e-16
  // seen 0: the same additions in the same order on both sides
  check_ref(
      "layer_norm dbeta", dbeta,
      [&](const int *p) {
        double s = 0;
        for (int b = 0; b < B; ++b) s += R(p[0], b);
        return s;
      },
      exact);
}

// Odd shapes (rows 5, width 7).
BOOST_FIXTURE_TEST_CASE(rms_norm, Fixture) {
  const int B = 5, C = 7;
  Buffer<double> x = random({C, B}), gamma = random({C}, 0.5, 1.5), R = random({C, B});
  ImageParam xp = param(x, "x"), gp = param(gamma, "gamma");
  auto stats = L.rms_norm_stats("rstd", xp, C);
  Func y = L.rms_norm("y", xp, stats.rstd, gp);
  auto rstd_of = [&](int b) {  // textbook: 1 / sqrt(mean of squares + eps)
    double ms = 0;
    for (int c = 0; c < C; ++c) ms += x(c, b) * x(c, b) / C;
    return 1 / std::sqrt(ms + Layers::rms_norm_eps);
  };
  const Buffer<double> rstd = stats.rstd.realize({B}), yb = y.realize({C, B});
  check_ref("rms_norm rstd", rstd, [&](const int *p) { return rstd_of(p[0]); }, {1e-15, 0});  // seen 1.2e-16
  check_ref("rms_norm y", yb, [&](const int *p) { return x(p) * rstd_of(p[1]) * gamma(p[0]); },
            {1e-15, 0});  // seen 2.3e-16
  Func dy = wrap(R, "dy");
  auto g = L.rms_norm_grad("s", "dx", xp, stats.rstd, gp, dy, C, B);
  Buffer<double> dx = g.dx.realize({C, B}), dgamma = g.dgamma.realize({C});
  auto J = [&] { return objective(y, R); };
  check_fd("rms_norm dx fd", x, dx, J, {1e-9, 0});               // seen 4.9e-10
  check_fd("rms_norm dgamma fd", gamma, dgamma, J, {5e-10, 0});  // seen 3.2e-10
  check_ref("rms_norm dx", dx,
            [&](const int *p) {  // d/dx of x_c r g_c with r = (mean x^2 + eps)^-1/2
              const int b = p[1];
              const double r = rstd_of(b);
              double sum = 0;  // sum_c R_c g_c x_c
              for (int c = 0; c < C; ++c) sum += R(c, b) * gamma(c) * x(c, b);
              return R(p) * gamma(p[0]) * r - x(p) * r * r * r * sum / C;
            },
            {2e-15, 0});  // seen 2.0e-16
  check_ref("rms_norm dgamma", dgamma,
            [&](const int *p) {
              double s = 0;
              for (int b = 0; b < B; ++b) s += R(p[0], b) * x(p[0], b) * rstd_of(b);
              return s;
            },
            {1e-15, 0});  // seen 1.5e-16
}

// SwiGLU on 2H = 2 x 5 features: [a | b] -> silu(a) * b.
BOOST_FIXTURE_TEST_CASE(swiglu, Fixture) {
  const int B = 4, H = 5;
  Buffer<double> x = random({2 * H, B}, -3, 3), R = random({H, B});
  ImageParam xp = param(x, "x");
  Func y = L.swiglu("y", xp, H);
  auto silu = [](double a) { return a / (1 + std::exp(-a)); };
  const Buffer<double> yb = y.realize({H, B});
  check_ref("swiglu y", yb, [&](const int *p) { return silu(x(p[0], p[1])) * x(p[0] + H, p[1]); },
            {1e-15, 0});  // seen 1.2e-16
  Buffer<double> dx = L.swiglu_grad("dx", xp, wrap(R, "dy"), H).realize({2 * H, B});
  check_fd("swiglu dx fd", x, dx, [&] { return objective(y, R); }, {2e-9, 0});  // seen 3.2e-10
  check_ref("swiglu dx", dx,
            [&](const int *p) {
              const int c = p[0] % H, b = p[1];
              const double a = x(c, b), up = x(c + H, b), s = 1 / (1 + std::exp(-a));
              return p[0] < H ? R(c, b) * up * (s + a * s * (1 - s)) : R(c, b) * silu(a);
            },
            {2e-15, 0});  // seen 8.3e-17
}

BOOST_FIXTURE_TEST_CASE(gelu_and_relu, Fixture) {
  const int B = 4, C = 7;
  // ReLU is not differentiable at 0: keep inputs away from it by more than the FD step.
  Buffer<double> x = random({C, B}, -3, 3), R = random({C, B});
  x.for_each_value([](double &a) {
    if (std::abs(a) < 1e-3) a = 0.5;
  });
  ImageParam xp = param(x, "x");
  Func dy = wrap(R, "dy");
  Func gelu = L.gelu("gelu", xp), relu = L.relu("relu", xp);
  Buffer<double> dgelu = L.gelu_grad("dgelu", xp, dy).realize({C, B}),
                 drelu = L.relu_grad("drelu", xp, dy).realize({C, B});
  check_fd("gelu fd", x, dgelu, [&] { return objective(gelu, R); }, {2e-9, 0});  // seen 5.2e-10
  check_fd("relu fd", x, drelu, [&] { return objective(relu, R); }, {2e-9, 0});  // seen 4.6e-10
  check_ref("gelu grad", dgelu,
            [&](const int *p) {  // derivative of 0.5 a (1 + tanh(k0 (a + k1 a^3)))
              const double a = x(p), t = std::tanh(Layers::gelu_k0 * (a + Layers::gelu_k1 * a * a * a));
              return R(p) *
                     (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * Layers::gelu_k0 * (1 + 3 * Layers::gelu_k1 * a * a));
            },
            {4e-15, 0});                                                                      // seen 7.3e-16
  check_ref("relu grad", drelu, [&](const int *p) { return x(p) > 0 ? R(p) : 0.0; }, exact);  // seen 0: a selection
  // GELU itself against std::tanh: the kernel's exp-based tanh is exact up to rounding.
  const Buffer<double> y = gelu.realize({C, B}), yr = relu.realize({C, B});
  check_ref("gelu forward", y,
            [&](const int *p) {
              const double a = x(p);
              return 0.5 * a * (1 + std::tanh(Layers::gelu_k0 * (a + Layers::gelu_k1 * a * a * a)));
            },
            {1e-15, 0});                                                                    // seen 1.5e-16
  check_ref("relu forward", yr, [&](const int *p) { return std::max(x(p), 0.0); }, exact);  // seen 0: a selection
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
  auto z = [&](int b) {  // sum of exp over the row, no max shift (|logits| <= 4)
    double s = 0;
    for (int k = 0; k < K; ++k) s += std::exp(logits(k, b));
    return s;
  };
  const Buffer<double> loss = ce.row_loss.realize({B});
  check_ref("row_loss", loss, [&](const int *p) { return std::log(z(p[0])) - logits(labels(p[0]), p[0]); },
            {2e-15, 0});  // seen 3.7e-16
  Buffer<double> dl = ce.dlogits.realize({K, B});
  check_fd("dlogits fd", logits, dl, [&] { return objective(ce.row_loss, ones); }, {5e-9, 0});  // seen 1.3e-9
  check_ref("dlogits", dl,
            [&](const int *p) { return std::exp(logits(p[0], p[1])) / z(p[1]) - (p[0] == labels(p[1]) ? 1 : 0); },
            {2e-15, 0});  // seen 3.4e-16
}

BOOST_FIXTURE_TEST_CASE(adamw_step, Fixture) {
  const int N = 9;
  Buffer<double> p = random({N}), g = random({N}), m = random({N}), var = random({N}, 0, 1);
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1, c1 = 0.19, c2 = 0.002;
  Func upd = L.adamw(param(p, "p"), param(g, "g"), param(m, "m"), param(var, "v"), L.constant(lr), L.constant(b1),
                     L.constant(b2), L.constant(eps), L.constant(wd), L.constant(c1), L.constant(c2));
  Realization r = upd.realize({N});
  const Buffer<double> p1 = r[0], m1 = r[1], v1 = r[2];
  auto em = [&](const int *i) { return b1 * m(i) + (1 - b1) * g(i); };
  auto ev = [&](const int *i) { return b2 * var(i) + (1 - b2) * g(i) * g(i); };
  check_ref("adamw m", m1, em, {5e-16, 0});  // seen 6.4e-17
  check_ref("adamw v", v1, ev, {1e-15, 0});  // seen 1.4e-16
  check_ref("adamw p", p1,
            [&](const int *i) { return p(i) - lr * ((em(i) / c1) / (std::sqrt(ev(i) / c2) + eps) + wd * p(i)); },
            {2.2e-16, 0});  // seen 0 (the step's rounding is scaled down by lr); the limit allows one ulp of the scale
}

// The checks can fail: with the very tolerances of the linear test, a Halide linear that reads
// its (square) weight transposed, a NaN input, and an input-gradient rule that forgets the
// transpose are each reported as mismatches; the correct linear passes the same comparison.
BOOST_FIXTURE_TEST_CASE(checks_detect_errors, Fixture) {
  const int B = 5, K = 7;  // out = in, so the transposed weight stays in bounds
  Buffer<double> x = random({K, B}), w = random({K, K}), bias = random({K}), R = random({K, B});
  ImageParam xp = param(x, "x"), wp = param(w, "w"), bp = param(bias, "b");
  const Buffer<double> expect_y = linear_ref(x, w, bias);
  auto ref = [&](const int *p) { return expect_y(p); };
  Func y = L.linear("y", xp, wp, bp, K).out, wrong = L.linear("y_wt", xp, L.transpose("wt", wp), bp, K).out;
  const Buffer<double> good = y.realize({K, B}), transposed = wrong.realize({K, B});
  expect("linear y, square weight", compare_ref(good, ref, linear_y_tol));
  const Comparison c = compare_ref(transposed, ref, linear_y_tol);
  BOOST_TEST(c.mismatches > 0u, c.describe());
  const double keep = x(3, 2);
  x(3, 2) = NAN;  // poisons row 2 of y: all K of its elements must mismatch
  const Buffer<double> poisoned = y.realize({K, B});
  x(3, 2) = keep;
  BOOST_TEST(compare_ref(poisoned, ref, linear_y_tol).mismatches == std::size_t(K));
  Func dy = wrap(R, "dy");
  const Buffer<double> dx_no_transpose = L.linear_input_grad("dx", dy, wp, K).out.realize({K, B});
  BOOST_TEST(compare_fd(x, dx_no_transpose, [&] { return objective(y, R); }, linear_dx_fd_tol).mismatches > 0u);
}
