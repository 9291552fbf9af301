// Every layer kind's forward and vector-Jacobian rule (its algorithm.h, JIT-compiled in float64)
// against a plain C++ reference and, for the rules, against central finite differences: the
// checks in each kind's folder (generators/kinds/<kind>/checks.h), run per kind; and the same for
// the loss and AdamW (generators/layers.h).
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
#include <optional>
#include <random>
#include <vector>
import remat.language;

#include "kind_checks.h"
#include "kind_checks_all.h"  // generated: every kind's checks.h (generators/kinds/list.h)

using namespace Halide;
using namespace remat;
using namespace remat::testing;

// ---- every layer kind's checks (generators/kinds/<kind>/checks.h) ----
// Each check is a test case of this suite, named as the check, registered with the others (at
// static initialization, as BOOST_AUTO_TEST_CASE does); the kinds are generators/kinds/list.h's.
template <Op op>
void register_checks() {
  if constexpr (requires { KindChecks<op>::checks; })
    for (const LayerCheck &check : KindChecks<op>::checks)
      boost::unit_test::framework::master_test_suite().add(
          boost::unit_test::make_test_case(check.run, check.name, __FILE__, __LINE__));
}
const bool kind_checks_registered = [] {
#define REMAT_KIND(name) register_checks<Op::name>();
#include "kinds/list.h"
#undef REMAT_KIND
  return true;
}();

// ---- what is not a layer kind: the loss, AdamW, and the checks themselves ----
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

// The checks can fail. Their subject here is a linear written in Halide for this test (the
// kernels' GEMMs are a library's): y(o, b) = sum_k x(k, b) w(o, k) + bias(o) and the input
// gradient dx(k, b) = sum_o dy(o, b) w(o, k), against plain loops with the tolerances a kind's
// checks use. A linear that reads its (square) weight transposed, a NaN input, and an input
// gradient that forgets the transpose are each reported as mismatches; the correct linear passes.
namespace {
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
// out(c, b) = [bias(c) +] sum_i a(i, b) m(c, i), over `inner` terms i
Func product(const gen::Vars &v, const std::string &name, Func a, Func m, int inner, std::optional<Func> bias = {}) {
  Func out(name);
  RDom i(0, inner, name + "_i");
  out(v.c, v.b) = bias ? Expr((*bias)(v.c)) : Expr(0.0);
  out(v.c, v.b) += a(i, v.b) * m(v.c, i);
  return out;
}
}  // namespace

BOOST_FIXTURE_TEST_CASE(checks_detect_errors, Fixture) {
  const Tolerance y_tol{5e-16, 0}, dx_fd_tol{1e-9, 0};  // a kind check's: rounding, and finite differences
  const int B = 5, K = 7;                               // out = in, so the transposed weight stays in bounds
  Buffer<double> x = random({K, B}), w = random({K, K}), bias = random({K}), R = random({K, B});
  ImageParam xp = param(x, "x"), wp = param(w, "w"), bp = param(bias, "b");
  const Buffer<double> expect_y = linear_ref(x, w, bias);
  auto ref = [&](const int *p) { return expect_y(p); };
  Func w_t("w_t");
  w_t(v.c, v.b) = wp(v.b, v.c);
  Func y = product(v, "y", xp, wp, K, Func(bp)), wrong = product(v, "y_wt", xp, w_t, K, Func(bp));
  const Buffer<double> good = y.realize({K, B}), transposed = wrong.realize({K, B});
  expect("linear y, square weight", compare_ref(good, ref, y_tol));
  const Comparison c = compare_ref(transposed, ref, y_tol);
  BOOST_TEST(c.mismatches > 0u, c.describe());
  const double keep = x(3, 2);
  x(3, 2) = NAN;  // poisons row 2 of y: all K of its elements must mismatch
  const Buffer<double> poisoned = y.realize({K, B});
  x(3, 2) = keep;
  BOOST_TEST(compare_ref(poisoned, ref, y_tol).mismatches == std::size_t(K));
  Func dy = wrap(R, "dy");
  const Buffer<double> dx = product(v, "dx", dy, w_t, K).realize({K, B}),
                       dx_no_transpose = product(v, "dx_wrong", dy, wp, K).realize({K, B});
  expect("linear dx", compare_fd(x, dx, [&] { return objective(y, R); }, dx_fd_tol));
  BOOST_TEST(compare_fd(x, dx_no_transpose, [&] { return objective(y, R); }, dx_fd_tol).mismatches > 0u);
}
