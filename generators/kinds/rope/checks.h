// The rope kind's float64 layer checks (tests/kind_checks.h; its algorithm JIT-compiled in float64):
// rotary position embedding against the rotation written out with std::cos and std::sin,
// its rule (the inverse rotation) against finite differences.
// Tolerances (compare.h: atol times the tensor's largest reference magnitude; NaN fails). The
// objective is J = sum(y * R) for a fixed random R, so dJ/dy = R. Each limit sits just above the
// worst error observed at these fixed seeds, stated beside it as "seen". A wrong term is an O(1e-1)
// error. Finite differences in float64 with step h = 1e-6: truncation O(h^2 |J'''|) ~ 1e-12 and
// rounding ~ 1e-16 |J| / h ~ 1e-10 for |J| ~ 1.
#pragma once

#include <Halide.h>

#include "kind_checks.h"
#include "kinds/rope/algorithm.h"

#include <cmath>
#include <cstdint>
#include <cstdio>

namespace remat::testing {

using gen::Dropout;

// RoPE on [q (2 heads) | k (1 head) | v] of D = 4 features, T = 3, N = 2 (the rotation of
// position t is its own: rows of other positions must not leak in): against the rotation
// written out with std::pow, std::cos and std::sin; its rule (the inverse rotation) against
// finite differences; the inverse undoing it; position 0 unrotated.
struct RopeCheck : Fixture {
  void run() {
    const int T = 3, N = 2, rows = N * T, H = 2, KV = 1, D = 4, W = (H + 2 * KV) * D;
    gen::Sequences seq{L, T};
    Buffer<double> x = random({W, rows}, -1.5, 1.5), R = random({W, rows});
    ImageParam xp = param(x, "x");
    Func y = gen::Rope(seq).rotate("y", xp, H, KV, D);
    const Buffer<double> yb = Buffer<double>(y.realize({W, rows})).copy();
    check_ref("rope y", yb,
              [&](const int *q) {
                const int c = q[0], b = q[1], e = c % D, half = D / 2;
                if (c >= (H + KV) * D) return x(c, b);  // v
                const double angle = (b % T) * std::pow(gen::Rope::default_theta, -2.0 * (e % half) / D);
                return e < half ? x(c, b) * std::cos(angle) - x(c + half, b) * std::sin(angle)
                                : x(c, b) * std::cos(angle) + x(c - half, b) * std::sin(angle);
              },
              {1e-15, 0});
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < W; ++c) BOOST_TEST(yb(c, n * T) == x(c, n * T));  // angle 0: cos 1, sin 0 exactly
    Buffer<double> dx = gen::Rope(seq).rotate("dx", wrap(R, "dy"), H, KV, D, true).realize({W, rows});
    check_fd("rope dx fd", x, dx, [&] { return objective(y, R); }, {1e-9, 0});
    Buffer<double> back = gen::Rope(seq).rotate("back", wrap(yb, "yb"), H, KV, D, true).realize({W, rows});
    check_ref("rope inverse", back, [&](const int *q) { return x(q); }, {1e-15, 0});
  }
};

template <>
struct KindChecks<Op::rope> {
  static constexpr LayerCheck checks[] = {{"rope", run_check<RopeCheck>}};
};

}  // namespace remat::testing
