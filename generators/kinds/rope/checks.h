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
#include <string>

namespace remat::testing {

using gen::Dropout;

// RoPE on [q (2 heads) | k (1 head) | v] of D features, T = 3, N = 2 (the rotation of position t is
// its own: rows of other positions must not leak in): against the rotation written out with
// std::pow, std::cos and std::sin; its rule (the inverse rotation) against finite differences; the
// inverse undoing it; position 0 unrotated. Twice: base 10000 (D = 4), and base 100000 scaled as
// llama3 (D = 8, factor 8, original context 400, low 1, high 8: wavelengths 6.3 kept, 112
// blended, 1987 and 35333 divided: every branch of the rule).
struct RopeCheck : Fixture {
  void run() {
    rotation("rope", 4, gen::Rope::default_theta, {});
    rotation("rope llama3", 8, 100000, {8, 1, 8, 400});
  }
  void rotation(const std::string &name, int D, double theta, gen::Rope::Llama3 s) {
    const int T = 3, N = 2, rows = N * T, H = 2, KV = 1, W = (H + 2 * KV) * D;
    gen::Sequences seq{L, T};
    const gen::Rope rope(seq, theta, s);
    Buffer<double> x = random({W, rows}, -1.5, 1.5), R = random({W, rows});
    ImageParam xp = param(x, "x");
    Func y = rope.rotate("y", xp, H, KV, D);
    const auto frequency = [&](int i) {
      const double f = std::pow(theta, -2.0 * i / D), wavelength = 2 * M_PI / f;
      if (s.factor == 0 || wavelength < s.original_context / s.high_freq_factor) return f;
      if (wavelength > s.original_context / s.low_freq_factor) return f / s.factor;
      const double k = (s.original_context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      return (1 - k) * f / s.factor + k * f;
    };
    const Buffer<double> yb = Buffer<double>(y.realize({W, rows})).copy();
    check_ref(name + " y", yb,
              [&](const int *q) {
                const int c = q[0], b = q[1], e = c % D, half = D / 2;
                if (c >= (H + KV) * D) return x(c, b);  // v
                const double angle = (b % T) * frequency(e % half);
                return e < half ? x(c, b) * std::cos(angle) - x(c + half, b) * std::sin(angle)
                                : x(c, b) * std::cos(angle) + x(c - half, b) * std::sin(angle);
              },
              {1e-15, 0});
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < W; ++c) BOOST_TEST(yb(c, n * T) == x(c, n * T));  // angle 0: cos 1, sin 0 exactly
    Buffer<double> dx = rope.rotate("dx", wrap(R, "dy"), H, KV, D, true).realize({W, rows});
    check_fd(name + " dx fd", x, dx, [&] { return objective(y, R); }, {1e-9, 0});
    Buffer<double> back = rope.rotate("back", wrap(yb, "yb"), H, KV, D, true).realize({W, rows});
    check_ref(name + " inverse", back, [&](const int *q) { return x(q); }, {1e-15, 0});
  }
};

template <>
struct KindChecks<Op::rope> {
  static constexpr LayerCheck checks[] = {{"rope", run_check<RopeCheck>}};
};

}  // namespace remat::testing
