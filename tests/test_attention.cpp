// Transformer layers (generators/attention.h, JIT-compiled in float64): causal multi-head
// attention forward and FlashAttention-style backward, attention and activation dropout from
// the counter-based RNG, and token + position embedding; each vector-Jacobian rule against
// central finite differences and against a plain C++ reference (naive loops, its own softmax,
// its own copy of the documented splitmix64 hash).
//
// Tolerances. The objective is J = sum(y * R) for a fixed random R, so dJ/dy = R.
// - Finite differences in float64 with step h = 1e-6: truncation error is O(h^2 |J'''|) ~ 1e-12
//   and rounding error ~ 1e-16 |J| / h ~ 1e-10 for |J| ~ 1, so |fd - vjp| <= 1e-7 (1 + |vjp|)
//   leaves three orders of margin while still catching any wrong term (those are O(1e-1)).
//   With dropout FD is still valid: the mask is a function of the counters (seed, step, block,
//   element) only, never of the data, so J stays smooth in the inputs.
// - The plain C++ reference computes the same quantities in float64 with other formulas and
//   summation orders (softmax with its own max shift, softmax Jacobian written as
//   P (g - sum P g) instead of P (dP - dout . out)): differences are rounding only,
//   |ref - vjp| <= 1e-11 (1 + |vjp|).
// - Causal masking, mask recompute and p = 0 are exact properties: compared bit for bit.
// - Kept fraction over 10^5 Bernoulli(1 - p) draws: standard deviation sqrt(p (1 - p) / 10^5)
//   ~ 1.4e-3 for p = 0.3, so a 1% (relative, 7e-3) band is a ~5 sigma check of the threshold.
#include <boost/test/unit_test.hpp>

#include <Halide.h>
#include <attention.h>

#include "counter_hash_ref.h"
#include "gradient_check.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

using namespace Halide;
using remat::gen::Dropout;
using remat::gen::Layers;
using remat::gen::Transformer;
using namespace remat::testing;

namespace {

bool identical(const Buffer<double> &a, const Buffer<double> &b) {
  bool same = a.number_of_elements() == b.number_of_elements();
  a.for_each_element([&](const int *pos) { same = same && a(pos) == b(pos); });
  return same;
}

// Plain causal multi-head attention on a [rows, 3C] qkv buffer. mult(h, n, t, s) is the dropout
// multiplier of P(h, n, t, s) (1 without dropout).
struct AttentionRef {
  int N, T, H, D, C;
  Buffer<double> qkv;
  std::function<double(int, int, int, int)> mult = [](int, int, int, int) { return 1.0; };

  double q(int n, int t, int h, int d) const { return qkv(h * D + d, n * T + t); }
  double k(int n, int s, int h, int d) const { return qkv(C + h * D + d, n * T + s); }
  double v(int n, int s, int h, int d) const { return qkv(2 * C + h * D + d, n * T + s); }
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
    Buffer<double> g(3 * C, N * T);
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
              g(2 * C + h * D + d, n * T + s) += p[s] * mult(h, n, t, s) * dout(h * D + d, n * T + t);
            }
            pg += p[s] * dp[s];
          }
          for (int s = 0; s <= t; ++s) {
            const double ds = p[s] * (dp[s] - pg);
            for (int d = 0; d < D; ++d) {
              g(h * D + d, n * T + t) += ds * k(n, s, h, d) * scale;
              g(C + h * D + d, n * T + s) += ds * q(n, t, h, d) * scale;
            }
          }
        }
    return g;
  }
};

// N = 2 sequences of T = 4 positions, H = 2 heads of D = 3 features.
struct AttentionFixture : Fixture {
  static constexpr int N = 2, T = 4, H = 2, D = 3, C = H * D, rows = N * T;
  Transformer tr{L, T};
  Buffer<double> qkv = random({3 * C, rows}, -1.5, 1.5), R = random({C, rows});
  ImageParam qkvp = param(qkv, "qkv");
  Param<uint64_t> seed{"seed", 0x5eedULL};
  Param<int> step{"step", 17};
  static constexpr double p = 0.3;
  Dropout drop{seed, step, Expr(3), p};
  AttentionRef ref{N, T, H, D, C, qkv};
  AttentionRef dropped_ref() const {
    AttentionRef r = ref;
    r.mult = [](int h, int n, int t, int s) {
      const uint64_t e = ((uint64_t(n) * H + h) * T + t) * T + s;
      return keep_ref(0x5eedULL, 17, 3, e, p) ? 1 / (1 - p) : 0.0;
    };
    return r;
  }
  // Forward, then backward from the forward's out and lse with dout = R.
  struct Run { remat::gen::Attention fwd; Buffer<double> out, lse, dqkv; remat::gen::AttentionGrad bwd; };
  Run run(const Dropout &d) {
    Run r;
    r.fwd = tr.attention("attn", qkvp, C, H, d);
    r.out = r.fwd.out.realize({C, rows});
    r.lse = r.fwd.lse.realize({H, rows});
    r.bwd = tr.attention_grad("dattn", qkvp, wrap(r.out, "out"), wrap(r.lse, "lse"), wrap(R, "dout"), C, H, d);
    r.dqkv = r.bwd.dqkv.realize({3 * C, rows});
    return r;
  }
};

}  // namespace

BOOST_FIXTURE_TEST_CASE(attention_forward, AttentionFixture) {
  auto a = tr.attention("attn", qkvp, C, H);
  Buffer<double> out = a.out.realize({C, rows}), expect = ref.out();
  check_ref("out", out, [&](const int *q) { return expect(q); });
}

BOOST_FIXTURE_TEST_CASE(attention_lse, AttentionFixture) {
  Buffer<double> lse = tr.attention("attn", qkvp, C, H).lse.realize({H, rows});
  check_ref("lse", lse, [&](const int *q) { return ref.lse(q[1] / T, q[0], q[1] % T); });
}

BOOST_FIXTURE_TEST_CASE(attention_backward, AttentionFixture) {
  Run r = run({});
  check_fd("dqkv", qkv, r.dqkv, [&] { return objective(r.fwd.out, R); });
  Buffer<double> expect = ref.dqkv(R);
  check_ref("dqkv", r.dqkv, [&](const int *q) { return expect(q); });
}

// Perturbing any q, k or v entry of position s leaves out at every position t < s of the same
// sequence, and all of the other sequence, bit-identical; out at position s itself moves (v).
BOOST_FIXTURE_TEST_CASE(attention_causal_mask, AttentionFixture) {
  Func out = tr.attention("attn", qkvp, C, H).out;
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
        if (unaffected) BOOST_TEST(same, "qkv(" << c << ", " << b << ") changed out row " << b2);
        else if (b2 == b && c >= 2 * C) BOOST_TEST(!same, "v(" << c << ", " << b << ") did not reach out row " << b);
      }
    }
}

BOOST_FIXTURE_TEST_CASE(attention_dropout_backward, AttentionFixture) {
  Run r = run(drop);
  const AttentionRef dref = dropped_ref();
  Buffer<double> expect_out = dref.out(), expect = dref.dqkv(R);
  check_ref("dropout out", r.out, [&](const int *q) { return expect_out(q); });
  check_fd("dropout dqkv", qkv, r.dqkv, [&] { return objective(r.fwd.out, R); });
  check_ref("dropout dqkv", r.dqkv, [&](const int *q) { return expect(q); });
  // lse is the undropped softmax's normalizer: dropout leaves it alone
  check_ref("dropout lse", r.lse, [&](const int *q) { return ref.lse(q[1] / T, q[0], q[1] % T); });
}

// The backward's mask, recomputed in another pipeline from the counters, is the forward's bit
// for bit, matches the C++ hash, and a second evaluation changes nothing.
BOOST_FIXTURE_TEST_CASE(attention_dropout_mask_recompute, AttentionFixture) {
  Run r = run(drop);
  Buffer<double> fwd = r.fwd.keep.realize({T, H, rows}), bwd = r.bwd.q.keep.realize({T, H, rows}), bwd_kv = r.bwd.kv.keep.realize({T, H, rows});
  Buffer<double> again = tr.attention("attn2", qkvp, C, H, drop).keep.realize({T, H, rows});
  BOOST_TEST(identical(fwd, bwd));
  // The key-side chain indexes the same mask by (query position, head, key row).
  bool transposed_same = true;
  bwd_kv.for_each_element([&](const int *q) {
    const int tq = q[0], h = q[1], key = q[2], n = key / T, s = key % T;
    if (tq >= s) transposed_same = transposed_same && bwd_kv(q) == fwd(s, h, n * T + tq);
  });
  BOOST_TEST(transposed_same);
  BOOST_TEST(identical(fwd, again));
  int dropped = 0;
  fwd.for_each_element([&](const int *q) {
    const int s = q[0], h = q[1], n = q[2] / T, t = q[2] % T;
    const uint64_t e = ((uint64_t(n) * H + h) * T + t) * T + s;
    const double want = keep_ref(0x5eedULL, 17, 3, e, p) ? 1 / (1 - p) : 0.0;
    BOOST_TEST(fwd(q) == want, "keep(" << s << ", " << h << ", " << q[2] << ")");
    dropped += want == 0;
  });
  BOOST_TEST(dropped > 0);  // the sizes above do exercise dropped probabilities
  // the whole forward and backward, evaluated again, are bit-identical
  Run r2 = run(drop);
  BOOST_TEST(identical(r.out, r2.out));
  BOOST_TEST(identical(r.dqkv, r2.dqkv));
}

// p = 0 is exactly no dropout: same out, lse and dqkv bits, and the mask itself keeps every
// element with factor exactly 1.
BOOST_FIXTURE_TEST_CASE(attention_dropout_p0, AttentionFixture) {
  Run plain = run({}), zero = run(Dropout{seed, step, Expr(3), 0.0});
  BOOST_TEST(identical(plain.out, zero.out));
  BOOST_TEST(identical(plain.lse, zero.lse));
  BOOST_TEST(identical(plain.dqkv, zero.dqkv));
  Func f("factor0");
  f(v.c, v.b) = tr.dropout_factor(Dropout{seed, step, Expr(3), 0.0}, tr.activation_element(v.c, v.b, 1000));
  Buffer<double> ones = f.realize({1000, 100});
  bool all_one = true;
  ones.for_each_value([&](double x) { all_one = all_one && x == 1.0; });
  BOOST_TEST(all_one);
}

// 10^5 mask bits: kept fraction within 1% of 1 - p, every bit equal to the C++ hash, identical
// when a fresh pipeline evaluates them again, and a different step draws a different mask.
BOOST_FIXTURE_TEST_CASE(dropout_keep_fraction, Fixture) {
  const int W = 1000, B = 100;
  const double p = 0.3;
  Transformer tr{L, 4};
  Param<uint64_t> seed{"seed", 99};
  Param<int> step{"step", 5};
  auto mask = [&](const std::string &name, Expr st) {
    Func m(name);
    m(v.c, v.b) = cast(UInt(8), remat::gen::keep_mask(seed, st, 7, tr.activation_element(v.c, v.b, W), p));
    return m;
  };
  Buffer<uint8_t> a = mask("mask_a", step).realize({W, B}), b = mask("mask_b", step).realize({W, B});
  Buffer<uint8_t> other = mask("mask_c", step + 1).realize({W, B});
  long kept = 0, same = 0, differ = 0, agree_ref = 0;
  for (int r = 0; r < B; ++r)
    for (int c = 0; c < W; ++c) {
      kept += a(c, r);
      same += a(c, r) == b(c, r);
      differ += a(c, r) != other(c, r);
      agree_ref += a(c, r) == (keep_ref(99, 5, 7, uint64_t(c) + uint64_t(W) * r, p) ? 1 : 0);
    }
  const double n = double(W) * B, frac = kept / n;
  BOOST_TEST(std::abs(frac - (1 - p)) <= 0.01 * (1 - p), "kept fraction " << frac);
  BOOST_TEST(same == W * B);
  BOOST_TEST(agree_ref == W * B);
  BOOST_TEST(differ > 0.3 * n, "step + 1 changed only " << differ << " bits");  // expect 2 p (1 - p) = 42%
}

BOOST_FIXTURE_TEST_CASE(dropout_forward_backward, Fixture) {
  const int B = 6, W = 7;
  const double p = 0.3;
  Transformer tr{L, 3};
  Buffer<double> x = random({W, B}), R = random({W, B});
  ImageParam xp = param(x, "x");
  Param<uint64_t> seed{"seed", 42};
  Dropout d{seed, Expr(2), Expr(1), p};
  Func y = tr.dropout("y", xp, W, d);
  Buffer<double> dx = tr.dropout_grad("dx", wrap(R, "dy"), W, d).realize({W, B});
  Buffer<double> yb = y.realize({W, B});
  auto factor = [&](const int *q) { return keep_ref(42, 2, 1, uint64_t(q[0]) + uint64_t(W) * q[1], p) ? 1 / (1 - p) : 0.0; };
  check_ref("dropout forward", yb, [&](const int *q) { return x(q) * factor(q); });
  check_fd("dropout dx", x, dx, [&] { return objective(y, R); });
  check_ref("dropout dx", dx, [&](const int *q) { return R(q) * factor(q); });
  int zeros = 0;
  yb.for_each_value([&](double a) { zeros += a == 0; });
  BOOST_TEST(zeros > 0);
  BOOST_TEST(zeros < W * B);
}

// V = 6 tokens (token 5 never occurs, tokens 0 and 3 repeat within and across sequences),
// T = 4, N = 3 sequences.
BOOST_FIXTURE_TEST_CASE(embedding, Fixture) {
  const int V = 6, C = 3, T = 4, N = 3, rows = N * T;
  Transformer tr{L, T};
  Buffer<double> wte = random({C, V}), wpe = random({C, T}), R = random({C, rows});
  Buffer<int> tokens(rows);
  const int toks[rows] = {0, 3, 3, 1, 3, 0, 2, 0, 4, 1, 3, 0};
  for (int b = 0; b < rows; ++b) tokens(b) = toks[b];
  ImageParam wtep = param(wte, "wte"), wpep = param(wpe, "wpe");
  ImageParam tp(Int(32), 1, "tokens");
  tp.set(tokens);
  Func x = tr.embedding("x", tp, wtep, wpep, V);
  auto g = tr.embedding_grad("demb", tp, wrap(R, "dx"), V, rows);
  Buffer<double> xb = x.realize({C, rows}), dwte = g.dwte.realize({C, V}), dwpe = g.dwpe.realize({C, T});
  check_ref("embedding", xb, [&](const int *q) { return wte(q[0], toks[q[1]]) + wpe(q[0], q[1] % T); });
  auto J = [&] { return objective(x, R); };
  check_fd("dwte", wte, dwte, J);
  check_fd("dwpe", wpe, dwpe, J);
  check_ref("dwte", dwte, [&](const int *q) {
    double s = 0;
    for (int b = 0; b < rows; ++b)
      if (toks[b] == q[1]) s += R(q[0], b);
    return s;
  });
  check_ref("dwpe", dwpe, [&](const int *q) {
    double s = 0;
    for (int n = 0; n < N; ++n) s += R(q[0], n * T + q[1]);
    return s;
  });
  for (int c = 0; c < C; ++c) BOOST_TEST(dwte(c, 5) == 0.0);  // unused token: no gradient
}
