// The embedding kind's float64 layer checks (tests/kind_checks.h; its algorithm JIT-compiled in float64):
// token + position embedding and its scatter-add rule against plain loops and
// finite differences.
// Tolerances (compare.h: atol times the tensor's largest reference magnitude; NaN fails). The
// objective is J = sum(y * R) for a fixed random R, so dJ/dy = R. Each limit sits just above the
// worst error observed at these fixed seeds, stated beside it as "seen". A wrong term is an O(1e-1)
// error. Finite differences in float64 with step h = 1e-6: truncation O(h^2 |J'''|) ~ 1e-12 and
// rounding ~ 1e-16 |J| / h ~ 1e-10 for |J| ~ 1.
#pragma once

#include <Halide.h>

#include "kind_checks.h"
#include "kinds/embedding/algorithm.h"

#include <cmath>
#include <cstdint>
#include <cstdio>

namespace remat::testing {

using gen::Dropout;

// V = 6 tokens (token 5 never occurs, tokens 0 and 3 repeat within and across sequences),
// T = 4, N = 3 sequences.
struct EmbeddingCheck : Fixture {
  void run() {
    const int V = 6, C = 3, T = 4, N = 3, rows = N * T;
    gen::Sequences seq{L, T};
    Buffer<double> wte = random({C, V}), wpe = random({C, T}), R = random({C, rows});
    Buffer<int> tokens(rows);
    const int toks[rows] = {0, 3, 3, 1, 3, 0, 2, 0, 4, 1, 3, 0};
    for (int b = 0; b < rows; ++b) tokens(b) = toks[b];
    ImageParam wtep = param(wte, "wte"), wpep = param(wpe, "wpe");
    ImageParam tp(Int(32), 1, "tokens");
    tp.set(tokens);
    Func x = gen::Embedding(seq).forward("x", tp, wtep, wpep, V);
    auto g = gen::Embedding(seq).grad("demb", tp, wrap(R, "dx"), V, rows);
    Buffer<double> xb = x.realize({C, rows}), dwte = g.dwte.realize({C, V}), dwpe = g.dwpe.realize({C, T});
    // seen 0 in the exact checks: one addition, or the same additions in the same order
    check_ref("embedding", xb, [&](const int *q) { return wte(q[0], toks[q[1]]) + wpe(q[0], q[1] % T); }, exact);
    auto J = [&] { return objective(x, R); };
    check_fd("dwte fd", wte, dwte, J, {2e-9, 0});  // seen 5.4e-10
    check_fd("dwpe fd", wpe, dwpe, J, {4e-9, 0});  // seen 7.2e-10
    check_ref(
        "dwte", dwte,
        [&](const int *q) {
          double s = 0;
          for (int b = 0; b < rows; ++b)
            if (toks[b] == q[1]) s += R(q[0], b);
          return s;
        },
        exact);
    check_ref(
        "dwpe", dwpe,
        [&](const int *q) {
          double s = 0;
          for (int n = 0; n < N; ++n) s += R(q[0], n * T + q[1]);
          return s;
        },
        exact);
    for (int c = 0; c < C; ++c) BOOST_TEST(dwte(c, 5) == 0.0);  // unused token: no gradient
  }
};

template <>
struct KindChecks<Op::embedding> {
  static constexpr LayerCheck checks[] = {{"embedding", run_check<EmbeddingCheck>}};
};

}  // namespace remat::testing
