// The dropout kind's float64 layer checks (tests/kind_checks.h; its algorithm JIT-compiled in float64):
// the counter-based mask against its plain C++ hash (tests/counter_hash_ref.h),
// its kept fraction, and the rule against finite differences.
// Tolerances (compare.h: atol times the tensor's largest reference magnitude; NaN fails). The
// objective is J = sum(y * R) for a fixed random R, so dJ/dy = R. Each limit sits just above the
// worst error observed at these fixed seeds, stated beside it as "seen". A wrong term is an O(1e-1)
// error. Finite differences in float64 with step h = 1e-6: truncation O(h^2 |J'''|) ~ 1e-12 and
// rounding ~ 1e-16 |J| / h ~ 1e-10 for |J| ~ 1.
#pragma once

#include <Halide.h>

#include "counter_hash_ref.h"
#include "kind_checks.h"
#include "kinds/dropout/algorithm.h"

#include <cmath>
#include <cstdint>
#include <cstdio>

namespace remat::testing {

using gen::Dropout;

// 10^5 mask bits at two steps: every bit equal to the C++ hash, kept fraction within 1% of
// 1 - p, and step + 1 draws a different mask.
struct DropoutKeepFractionCheck : Fixture {
  void run() {
    const int W = 1000, B = 100;
    const double p = 0.3;

    Param<uint64_t> seed{"seed", 99};
    Param<int> step{"step", 5};
    auto mask = [&](const std::string &name, Expr st) {
      Func m(name);
      m(v.c, v.b) = cast(UInt(8), gen::keep_mask(seed, st, 7, gen::activation_element(v.c, v.b, W), p));
      return m;
    };
    Buffer<uint8_t> a = mask("mask_a", step).realize({W, B}), other = mask("mask_b", step + 1).realize({W, B});
    long kept = 0, differ = 0, agree_ref = 0;
    for (int r = 0; r < B; ++r)
      for (int c = 0; c < W; ++c) {
        const uint64_t e = uint64_t(c) + uint64_t(W) * r;
        kept += a(c, r);
        differ += a(c, r) != other(c, r);
        agree_ref += a(c, r) == (keep_ref(99, 5, 7, e, p) ? 1 : 0) && other(c, r) == (keep_ref(99, 6, 7, e, p) ? 1 : 0);
      }
    const double n = double(W) * B, frac = kept / n;
    if (show_errors())
      std::printf("[errors] kept fraction %.6f (|error| %.3g of 1 - p), step + 1 changed %ld bits\n", frac,
                  std::abs(frac - (1 - p)) / (1 - p), differ);
    BOOST_TEST(std::abs(frac - (1 - p)) <= 0.01 * (1 - p), "kept fraction " << frac);  // seen 3.5e-3 (0.70247)
    BOOST_TEST(agree_ref == W * B);
    BOOST_TEST(differ > 0.3 * n,
               "step + 1 changed only " << differ << " bits");  // expect 2 p (1 - p) = 42%, seen 41.9%
  }
};

struct DropoutForwardBackwardCheck : Fixture {
  void run() {
    const int B = 6, W = 7;
    const double p = 0.3;

    Buffer<double> x = random({W, B}), R = random({W, B});
    ImageParam xp = param(x, "x");
    Param<uint64_t> seed{"seed", 42};
    Dropout d{seed, Expr(2), Expr(1), p};
    Func y = gen::dropout(L, "y", xp, W, d);
    Buffer<double> dx = gen::dropout_grad(L, "dx", wrap(R, "dy"), W, d).realize({W, B});
    Buffer<double> yb = y.realize({W, B});
    auto factor = [&](const int *q) {
      return keep_ref(42, 2, 1, uint64_t(q[0]) + uint64_t(W) * q[1], p) ? 1 / (1 - p) : 0.0;
    };
    // seen 0 in the exact checks: one multiplication on both sides
    check_ref("dropout forward", yb, [&](const int *q) { return x(q) * factor(q); }, exact);
    check_fd("dropout dx fd", x, dx, [&] { return objective(y, R); }, {2e-9, 0});  // seen 4.4e-10
    check_ref("dropout dx", dx, [&](const int *q) { return R(q) * factor(q); }, exact);
    int zeros = 0;
    yb.for_each_value([&](double a) { zeros += a == 0; });
    BOOST_TEST(zeros > 0);
    BOOST_TEST(zeros < W * B);
  }
};

template <>
struct KindChecks<Op::dropout> {
  static constexpr LayerCheck checks[] = {{"dropout_keep_fraction", run_check<DropoutKeepFractionCheck>},
                                          {"dropout_forward_backward", run_check<DropoutForwardBackwardCheck>}};
};

}  // namespace remat::testing
