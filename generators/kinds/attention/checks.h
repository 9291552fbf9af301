// The attention kind's float64 layer checks (tests/kind_checks.h; its algorithm JIT-compiled in
// float64): causal multi-head and grouped-query attention forward and FlashAttention-style
// backward (the GPU kernels' formulation; tests/test_attention.cpp checks the CPU kernels'),
// attention dropout from the counter-based RNG; each rule against central finite differences and against a plain C++
// reference (naive loops, its own softmax, its own copy of the documented splitmix64 hash).
//
// Tolerances (compare.h: atol times the tensor's largest reference magnitude; NaN fails). The
// objective is J = sum(y * R) for a fixed random R, so dJ/dy = R. Each limit sits just above
// the worst error observed at these fixed seeds, stated beside it as "seen". A wrong term is an
// O(1e-1) error.
// - Finite differences in float64 with step h = 1e-6: truncation O(h^2 |J'''|) ~ 1e-12 and
//   rounding ~ 1e-16 |J| / h ~ 1e-10 for |J| ~ 1. With dropout FD is still valid: the mask is a
//   function of the counters (seed, step, block, element) only, never of the data, so J stays
//   smooth in the inputs.
// - The plain C++ reference computes the same quantities in float64 with other formulas and
//   summation orders (softmax with its own max shift, softmax Jacobian written as
//   P (g - sum P g) instead of P (dP - dout . out)): differences are rounding only, a few ulps
//   (2.2e-16) of the scale.
// - Causal masking and every mask against the C++ hash are exact properties: bit for bit.
// - Kept fraction over 10^5 Bernoulli(1 - p) draws: standard deviation sqrt(p (1 - p) / 10^5)
//   ~ 1.4e-3 for p = 0.3, so a 1% (relative, 7e-3) band is a ~5 sigma check of the threshold.
#pragma once

#include <Halide.h>

#include "counter_hash_ref.h"
#include "kind_checks.h"
#include "kinds/attention/algorithm.h"
#include "kinds/rope/algorithm.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

namespace remat::testing {

using gen::Dropout;

// Shared by the tests that compare an undropped run with the plain reference.
constexpr Tolerance out_tol{1e-15, 0},  // seen 2.3e-16 of scale (forward and p = 0 alike)
    lse_tol{5e-16, 0},                  // seen 1.0e-16
    dqkv_tol{1e-15, 0};                 // seen 2.4e-16

// Plain causal multi-head attention on a [rows, 3C] qkv buffer. mult(h, n, t, s) is the dropout
// multiplier of P(h, n, t, s) (1 without dropout).
struct AttentionRef {
  int N, T, H, D, C;
  Buffer<double> qkv;
  std::function<double(int, int, int, int)> mult = [](int, int, int, int) { return 1.0; };
  int KV = 0;  // key / value heads (0: H); query head h reads head h / (H / KV)

  int kv() const { return KV ? KV : H; }
  int k_col(int h, int d) const { return C + h / (H / kv()) * D + d; }
  int v_col(int h, int d) const { return C + kv() * D + h / (H / kv()) * D + d; }
  double q(int n, int t, int h, int d) const { return qkv(h * D + d, n * T + t); }
  double k(int n, int s, int h, int d) const { return qkv(k_col(h, d), n * T + s); }
  double v(int n, int s, int h, int d) const { return qkv(v_col(h, d), n * T + s); }
  double score(int n, int h, int t, int s) const {
    double x = 0;
    for (int d = 0; d < D; ++d) x += q(n, t, h, d) * k(n, s, h, d);
    return x / std::sqrt(double(D));
  }
  std::vector<double> softmax(int n, int h, int t) const {
    double m = -INFINITY, z = 0;
    std::vector<double> p(t + 1);
    for (int s = 0; s <= t; ++s) m = std::max(m, score(n, h, t, s));
    for (int s = 0; s <= t; ++s) z += p[s] = std::exp(score(n, h, t, s) - m);
    for (double &x : p) x /= z;
    return p;
  }
  double lse(int n, int h, int t) const {
    double z = 0;
    for (int s = 0; s <= t; ++s) z += std::exp(score(n, h, t, s));
    return std::log(z);
  }
  Buffer<double> out() const {
    Buffer<double> o(C, N * T);
    o.fill(0);
    for (int n = 0; n < N; ++n)
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < T; ++t) {
          auto p = softmax(n, h, t);
          for (int s = 0; s <= t; ++s)
            for (int d = 0; d < D; ++d) o(h * D + d, n * T + t) += p[s] * mult(h, n, t, s) * v(n, s, h, d);
        }
    return o;
  }
  // Textbook chain rule: g = dJ/dP, softmax Jacobian dS = P (g - sum P g).
  Buffer<double> dqkv(const Buffer<double> &dout) const {
    Buffer<double> g(C + 2 * kv() * D, N * T);
    g.fill(0);
    const double scale = 1 / std::sqrt(double(D));
    for (int n = 0; n < N; ++n)
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < T; ++t) {
          auto p = softmax(n, h, t);
          std::vector<double> dp(t + 1, 0.0);
          double pg = 0;
          for (int s = 0; s <= t; ++s) {
            for (int d = 0; d < D; ++d) {
              dp[s] += dout(h * D + d, n * T + t) * v(n, s, h, d) * mult(h, n, t, s);
              g(v_col(h, d), n * T + s) += p[s] * mult(h, n, t, s) * dout(h * D + d, n * T + t);
            }
            pg += p[s] * dp[s];
          }
          for (int s = 0; s <= t; ++s) {
            const double ds = p[s] * (dp[s] - pg);
            for (int d = 0; d < D; ++d) {
              g(h * D + d, n * T + t) += ds * k(n, s, h, d) * scale;
              g(k_col(h, d), n * T + s) += ds * q(n, t, h, d) * scale;
            }
          }
        }
    return g;
  }
};

// N = 2 sequences of T = 4 positions, H = 2 heads of D = 3 features.
struct AttentionFixture : Fixture {
  static constexpr int N = 2, T = 4, H = 2, D = 3, C = H * D, rows = N * T;
  gen::Sequences seq{L, T};
  gen::CausalAttention tr{seq};
  Buffer<double> qkv = random({3 * C, rows}, -1.5, 1.5), R = random({C, rows});
  ImageParam qkvp = param(qkv, "qkv");
  Param<uint64_t> seed{"seed", 0x5eedULL};
  Param<int> step{"step", 17};
  static constexpr double p = 0.3;
  Dropout drop{seed, step, Expr(3), p};
  AttentionRef ref{N, T, H, D, C, qkv};
  // The dropout multiplier of P(h, n, t, s) from the C++ hash, element index as documented.
  static double mult_ref(int h, int n, int t, int s) {
    const uint64_t e = ((uint64_t(n) * H + h) * T + t) * T + s;
    return keep_ref(0x5eedULL, 17, 3, e, p) ? 1 / (1 - p) : 0.0;
  }
  AttentionRef dropped_ref() const {
    AttentionRef r = ref;
    r.mult = mult_ref;
    return r;
  }
  double lse_ref(const int *q) const { return ref.lse(q[1] / T, q[0], q[1] % T); }  // lse(h, b)
  // Forward, then backward from the forward's out and lse with dout = R.
  struct ForwardBackward {
    gen::Attention fwd;
    Buffer<double> out, lse, dqkv;
    gen::AttentionGrad bwd;
  };
  ForwardBackward forward_backward(const Dropout &d) {
    ForwardBackward r;
    r.fwd = tr.attention("attn", qkvp, C, H, d);
    r.out = r.fwd.out.realize({C, rows});
    r.lse = r.fwd.lse.realize({H, rows});
    r.bwd = tr.attention_grad("dattn", qkvp, wrap(r.out, "out"), wrap(r.lse, "lse"), wrap(R, "dout"), C, H, d);
    r.dqkv = r.bwd.dqkv.realize({3 * C, rows});
    return r;
  }
};

// Perturbing any q, k or v entry of position s leaves out (rows x C) at every position t < s of the
// same sequence, and all of the other sequences, bit-identical; out at position s itself moves
// (v). qkv is the buffer `out` reads (rows x 3C), perturbed in place.
inline void expect_causal(Func out, Buffer<double> &qkv, int C, int T, int rows) {
  const Buffer<double> base = Buffer<double>(out.realize({C, rows})).copy();
  for (int b = 0; b < rows; ++b)
    for (int c = 0; c < 3 * C; ++c) {
      const int n = b / T, s = b % T;
      const double keep = qkv(c, b);
      qkv(c, b) = keep + 0.37;
      Buffer<double> o = out.realize({C, rows});
      qkv(c, b) = keep;
      for (int b2 = 0; b2 < rows; ++b2) {
        const bool unaffected = b2 / T != n || b2 % T < s;
        bool same = true;
        for (int c2 = 0; c2 < C; ++c2) same = same && o(c2, b2) == base(c2, b2);
        if (unaffected)
          BOOST_TEST(same, "qkv(" << c << ", " << b << ") changed out row " << b2);
        else if (b2 == b && c >= 2 * C)
          BOOST_TEST(!same, "v(" << c << ", " << b << ") did not reach out row " << b);
      }
    }
}

struct AttentionForwardCheck : AttentionFixture {
  void run() {
    auto a = tr.attention("attn", qkvp, C, H);
    Buffer<double> out = a.out.realize({C, rows}), expect = ref.out();
    check_ref("out", out, [&](const int *q) { return expect(q); }, out_tol);
  }
};

struct AttentionLseCheck : AttentionFixture {
  void run() {
    Buffer<double> lse = tr.attention("attn", qkvp, C, H).lse.realize({H, rows});
    check_ref("lse", lse, [&](const int *q) { return lse_ref(q); }, lse_tol);
  }
};

struct AttentionBackwardCheck : AttentionFixture {
  void run() {
    ForwardBackward r = forward_backward({});
    check_fd("dqkv fd", qkv, r.dqkv, [&] { return objective(r.fwd.out, R); }, {1e-9, 0});  // seen 1.6e-10
    Buffer<double> expect = ref.dqkv(R);
    check_ref("dqkv", r.dqkv, [&](const int *q) { return expect(q); }, dqkv_tol);
  }
};

struct AttentionCausalMaskCheck : AttentionFixture {
  void run() { expect_causal(tr.attention("attn", qkvp, C, H).out, qkv, C, T, rows); }
};

// Grouped-query attention: H = 4 query heads of D = 3 sharing KV = 2 key / value heads, with
// attention dropout. Both forward forms against the plain reference (its own column map); the
// row-form backward (which sums each shared head's gradient over its query heads) against the
// reference and finite differences.
struct GroupedQueryAttentionCheck : AttentionFixture {
  void run() {
    constexpr int H4 = 4, KV = 2, D3 = 3, C12 = H4 * D3, W = (H4 + 2 * KV) * D3;
    Buffer<double> x = random({W, rows}, -1.5, 1.5), dout = random({C12, rows});
    ImageParam xp = param(x, "qkv_gqa");
    AttentionRef gref{N, T, H4, D3, C12, x};
    gref.KV = KV;
    gref.mult = [](int h, int n, int t, int s) {
      const uint64_t e = ((uint64_t(n) * H4 + h) * T + t) * T + s;
      return keep_ref(0x5eedULL, 17, 3, e, p) ? 1 / (1 - p) : 0.0;
    };
    auto a = tr.attention("gqa", xp, C12, H4, drop, {}, {}, KV);
    Func out = a.out;
    const Buffer<double> ob = Buffer<double>(out.realize({C12, rows})).copy(), lse = a.lse.realize({H4, rows}),
                         expect = gref.out();
    check_ref("gqa out", ob, [&](const int *q) { return expect(q); }, out_tol);
    auto g = tr.attention_grad("dgqa", xp, wrap(ob, "out"), wrap(lse, "lse"), wrap(dout, "dout"), C12, H4, drop, KV);
    Buffer<double> dx = g.dqkv.realize({W, rows});
    check_fd("gqa dqkv fd", x, dx, [&] { return objective(out, dout); }, {1e-9, 0});
    const Buffer<double> edx = gref.dqkv(dout);
    check_ref("gqa dqkv", dx, [&](const int *q) { return edx(q); }, dqkv_tol);
    // dv from a key-side chain of its own
    const Buffer<double> own_dv = tr.attention_grad("dgqa_own_dv", xp, wrap(ob, "out_own_dv"), wrap(lse, "lse_own_dv"),
                                                    wrap(dout, "dout_own_dv"), C12, H4, drop, KV, true)
                                      .dqkv.realize({W, rows});
    check_ref("gqa dqkv (dv's own chain)", own_dv, [&](const int *q) { return edx(q); }, dqkv_tol);
  }
};

// The causal mask with RoPE before the attention (D = 4: RoPE turns pairs of features).
struct RopeAttentionCausalMaskCheck : Fixture {
  void run() {
    const int T = 4, N = 2, rows = N * T, H = 2, D = 4, C = H * D;
    gen::Sequences seq{L, T};
    gen::CausalAttention tr{seq};
    Buffer<double> qkv = random({3 * C, rows}, -1.5, 1.5);
    ImageParam qkvp = param(qkv, "qkv");
    Func rotated = gen::Rope(seq).rotate("rot", qkvp, H, H, D);
    expect_causal(tr.attention("attn", rotated, C, H).out, qkv, C, T, rows);
  }
};

struct AttentionDropoutBackwardCheck : AttentionFixture {
  void run() {
    ForwardBackward r = forward_backward(drop);
    const AttentionRef dref = dropped_ref();
    Buffer<double> expect_out = dref.out(), expect = dref.dqkv(R);
    check_ref("dropout out", r.out, [&](const int *q) { return expect_out(q); }, {1e-15, 0});      // seen 2.2e-16
    check_fd("dropout dqkv fd", qkv, r.dqkv, [&] { return objective(r.fwd.out, R); }, {2e-9, 0});  // seen 3.0e-10
    check_ref("dropout dqkv", r.dqkv, [&](const int *q) { return expect(q); }, {1e-15, 0});        // seen 1.7e-16
    // lse is the undropped softmax's normalizer: dropout leaves it alone
    check_ref("dropout lse", r.lse, [&](const int *q) { return lse_ref(q); }, lse_tol);
  }
};

// Each mask pipeline (the forward's, and the backward's query-side and key-side recomputes,
// each built from its own Funcs) against the C++ hash, bit for bit: so they agree with each
// other exactly, as recompute needs.
struct AttentionDropoutMaskRecomputeCheck : AttentionFixture {
  void run() {
    ForwardBackward r = forward_backward(drop);
    const Buffer<double> fwd = r.fwd.keep.realize({T, H, rows}), bwd = r.bwd.q.keep.realize({T, H, rows}),
                         bwd_kv = r.bwd.kv.keep.realize({T, H, rows});
    // The forward and the query side index keep(s, h, query row); the key side keep(t, h, key row).
    auto by_query = [](const int *q) { return mult_ref(q[1], q[2] / T, q[2] % T, q[0]); };
    check_ref("forward mask", fwd, by_query, exact);
    check_ref("backward query-side mask", bwd, by_query, exact);
    check_ref(
        "backward key-side mask", bwd_kv, [](const int *q) { return mult_ref(q[1], q[2] / T, q[0], q[2] % T); }, exact);
    int dropped = 0;
    fwd.for_each_element([&](const int *q) { dropped += q[0] <= q[2] % T && fwd(q) == 0; });
    BOOST_TEST(dropped > 0);  // the sizes above do drop causal probabilities
  }
};

// p = 0 is exactly no dropout. A constant p = 0 builds no mask at all (the plain pipeline, which
// the tests above check). The run-time form (threshold 0, scale 1) does evaluate the mask: every
// factor is exactly 1, and out, lse and dqkv match the undropped reference as the plain ones do.
struct AttentionDropoutP0Check : AttentionFixture {
  void run() {
    BOOST_TEST(!Dropout(seed, step, Expr(3), 0.0).enabled);
    Param<uint64_t> threshold{"threshold", uint64_t{0}};
    Param<double> scale{"scale", 1.0};
    const Dropout p0{seed, step, Expr(3), threshold, scale};
    ForwardBackward zero = forward_backward(p0);
    const Buffer<double> expect_out = ref.out(), expect_dqkv = ref.dqkv(R);
    check_ref("p0 out", zero.out, [&](const int *q) { return expect_out(q); }, out_tol);
    check_ref("p0 lse", zero.lse, [&](const int *q) { return lse_ref(q); }, lse_tol);
    check_ref("p0 dqkv", zero.dqkv, [&](const int *q) { return expect_dqkv(q); }, dqkv_tol);
    Func f("factor0");
    f(v.c, v.b) = gen::dropout_factor(L, p0, gen::activation_element(v.c, v.b, 1000));
    const Buffer<double> ones = f.realize({1000, 100});
    check_ref("p0 factor", ones, [](const int *) { return 1.0; }, exact);
  }
};

template <>
struct KindChecks<Op::attention> {
  static constexpr LayerCheck checks[] = {
      {"attention_forward", run_check<AttentionForwardCheck>},
      {"attention_lse", run_check<AttentionLseCheck>},
      {"attention_backward", run_check<AttentionBackwardCheck>},
      {"attention_causal_mask", run_check<AttentionCausalMaskCheck>},
      {"grouped_query_attention", run_check<GroupedQueryAttentionCheck>},
      {"rope_attention_causal_mask", run_check<RopeAttentionCausalMaskCheck>},
      {"attention_dropout_backward", run_check<AttentionDropoutBackwardCheck>},
      {"attention_dropout_mask_recompute", run_check<AttentionDropoutMaskRecomputeCheck>},
      {"attention_dropout_p0", run_check<AttentionDropoutP0Check>}};
};

}  // namespace remat::testing
