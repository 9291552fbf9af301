// The CPU kernels' attention (runtime/attention.cpp) against a float64 reference written as plain
// loops (its own softmax, its own copy of the dropout hash): lse, out and dqkv, fp32 and bf16,
// multi-head and grouped-query, context lengths that are and are not multiples of the blocks
// (64 rows) and chunks (128 positions), with and without dropout; and its bits: a repeated call
// (a recompute) gives the same bits.
//
// Limits (the largest error over the tensor's largest reference magnitude). fp32: every value is
// a sum of at most T + D products rounded in fp32 (unit roundoff 6e-8), P from the file's own exp
// (within 0.57 ulp, runtime/exp_float.h): dozens of ulps of the scale, so 4e-6 for out and dqkv (seen at most 2.7e-7
// and 4.7e-7) and 5e-7 for lse (seen 1.0e-7). bf16: the reference reads the same bf16 inputs;
// P and dS are rounded to bf16 before their products on every CPU (as PyTorch's bf16 attention
// does; 2^-9 of each term), and the outputs are rounded once after the fp32 sums (at most 2^-8 =
// 3.9e-3 of each value), so 5e-3 (seen out 3.4e-3, dqkv 2.6e-3); an fp32 dqkv of bf16 inputs is
// the same sums unrounded (seen 1.9e-3 on the dot kernel; test_attention_avx2's products are
// sgemms of widened operands), and rounded it is the bf16 dqkv bit for bit. A wrong term (a
// missing key, a transposed head, a mask off by one position) is an error of order 1e-1.
#include <boost/test/unit_test.hpp>

#include "attention.h"
#include "bf16.h"
#include "compare.h"
#include "counter_hash_ref.h"
#include "exp_float.h"

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace remat;

namespace {

struct Case {
  int N, T, H, KV, D;
  bool bf16 = false;
  double p = 0;  // attention dropout
};

struct Reference {  // float64, from the inputs as the kernel reads them
  Case c;
  std::vector<double> qkv, dout, lse, out, delta, dqkv;
  int width() const { return (c.H + 2 * c.KV) * c.D; }
  double q(int row, int h, int d) const { return qkv[row * width() + h * c.D + d]; }
  double k(int row, int h, int d) const { return qkv[row * width() + c.H * c.D + h / (c.H / c.KV) * c.D + d]; }
  double v(int row, int h, int d) const { return qkv[row * width() + (c.H + c.KV) * c.D + h / (c.H / c.KV) * c.D + d]; }
  double mult(int n, int h, int t, int s) const {
    if (c.p == 0) return 1;
    const uint64_t T = c.T, element = (uint64_t(n) * c.H + h) * T * T + uint64_t(t) * T + s;
    return testing::keep_ref(7, 3, 5, element, c.p) ? 1 / (1 - c.p) : 0;
  }
  void run() {
    const int rows = c.N * c.T, C = c.H * c.D;
    lse.assign(rows * c.H, 0), out.assign(rows * C, 0), delta.assign(rows * c.H, 0), dqkv.assign(rows * width(), 0);
    for (int n = 0; n < c.N; ++n)
      for (int h = 0; h < c.H; ++h)
        for (int t = 0; t < c.T; ++t) {
          const int row = n * c.T + t;
          std::vector<double> score(t + 1), prob(t + 1), dprob(t + 1);
          double mx = -INFINITY, sum = 0;
          for (int s = 0; s <= t; ++s) {
            for (int d = 0; d < c.D; ++d) score[s] += q(row, h, d) * k(n * c.T + s, h, d);
            score[s] /= std::sqrt(double(c.D));
            mx = std::max(mx, score[s]);
          }
          for (int s = 0; s <= t; ++s) sum += std::exp(score[s] - mx);
          lse[row * c.H + h] = mx + std::log(sum);
          for (int s = 0; s <= t; ++s) prob[s] = std::exp(score[s] - mx) / sum;
          for (int d = 0; d < c.D; ++d) {
            double o = 0;
            for (int s = 0; s <= t; ++s) o += prob[s] * mult(n, h, t, s) * v(n * c.T + s, h, d);
            out[row * C + h * c.D + d] = o;
          }
          // softmax Jacobian as P (g - sum P g), g = dL/dP = mult dout . v
          double pg = 0;
          for (int s = 0; s <= t; ++s) {
            for (int d = 0; d < c.D; ++d) dprob[s] += dout[row * C + h * c.D + d] * v(n * c.T + s, h, d);
            dprob[s] *= mult(n, h, t, s);
            pg += prob[s] * dprob[s];
          }
          for (int d = 0; d < c.D; ++d)
            delta[row * c.H + h] += dout[row * C + h * c.D + d] * out[row * C + h * c.D + d];
          const int kv = h / (c.H / c.KV);
          for (int s = 0; s <= t; ++s) {
            const double ds = prob[s] * (dprob[s] - pg) / std::sqrt(double(c.D)), kept = prob[s] * mult(n, h, t, s);
            const int key = n * c.T + s;
            for (int d = 0; d < c.D; ++d) {
              dqkv[row * width() + h * c.D + d] += ds * k(key, h, d);
              dqkv[key * width() + C + kv * c.D + d] += ds * q(row, h, d);
              dqkv[key * width() + C + (c.KV + kv) * c.D + d] += kept * dout[row * C + h * c.D + d];
            }
          }
        }
  }
};

// Tensors as the kernel stores them: fp32, or bf16 bits.
struct Stored {
  bool bf16;
  std::vector<float> f;
  std::vector<uint16_t> h;
  Stored(bool bf16, std::size_t n) : bf16(bf16), f(bf16 ? 0 : n), h(bf16 ? n : 0) {}
  void *data() { return bf16 ? static_cast<void *>(h.data()) : f.data(); }
  double at(std::size_t i) const { return bf16 ? bf16_to_float(h[i]) : f[i]; }
  std::size_t size() const { return bf16 ? h.size() : f.size(); }
  void set(std::size_t i, double x) {
    if (bf16)
      h[i] = float_to_bf16(float(x));
    else
      f[i] = float(x);
  }
  bool operator==(const Stored &o) const { return f == o.f && h == o.h; }
};

// The largest error over the largest |ref|; NaN when a value or a reference is not finite.
double worst(const std::vector<double> &ref, auto value) {
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    err = testing::worse(err, std::abs(value(i) - ref[i]));
    scale = testing::worse(scale, std::abs(ref[i]));
  }
  return err / scale;
}

void check(const Case &c) {
  const int rows = c.N * c.T, C = c.H * c.D, width = (c.H + 2 * c.KV) * c.D;
  std::mt19937 rng(c.T * 131 + c.H * 7 + c.KV + c.D);
  std::normal_distribution<double> normal;
  Stored qkv(c.bf16, std::size_t(rows) * width), dout(c.bf16, std::size_t(rows) * C);
  Reference ref{c};
  for (std::size_t i = 0; i < qkv.size(); ++i) qkv.set(i, normal(rng)), ref.qkv.push_back(qkv.at(i));
  for (std::size_t i = 0; i < dout.size(); ++i) dout.set(i, normal(rng)), ref.dout.push_back(dout.at(i));
  ref.run();

  AttentionCall call{.qkv = qkv.data(), .rows = rows, .T = c.T, .H = c.H, .KV = c.KV, .D = c.D, .bf16 = c.bf16};
  if (c.p > 0)
    call.dropout = true, call.seed = 7, call.step = 3, call.block = 5,
    call.threshold = uint64_t(std::llround(c.p * 4294967296.0)), call.scale = float(1 / (1 - c.p));
  std::vector<float> lse(std::size_t(rows) * c.H), delta(std::size_t(rows) * c.H);
  Stored out(c.bf16, std::size_t(rows) * C), again(c.bf16, out.size()), dqkv(c.bf16, std::size_t(rows) * width),
      dqkv_again(c.bf16, dqkv.size());
  std::vector<float> per_head(std::size_t(rows) * 3 * C);
  attention_lse(call, lse.data());
  attention_out(call, lse.data(), out.data());
  for (std::size_t i = 0; i < delta.size(); ++i) delta[i] = float(ref.delta[i]);
  attention_grad(call, lse.data(), dout.data(), delta.data(), per_head.data(), dqkv.data());

  const double fp32_tol = 4e-6, tol = c.bf16 ? 5e-3 : fp32_tol;
  BOOST_TEST_CONTEXT("N " << c.N << " T " << c.T << " H " << c.H << " KV " << c.KV << " D " << c.D << " bf16 " << c.bf16
                          << " p " << c.p) {
    BOOST_TEST(worst(ref.lse, [&](std::size_t i) { return lse[i]; }) < 5e-7);
    BOOST_TEST(worst(ref.out, [&](std::size_t i) { return out.at(i); }) < tol);
    BOOST_TEST(worst(ref.dqkv, [&](std::size_t i) { return dqkv.at(i); }) < tol);
    // a recompute from the saved statistics, and the gradient again: the same bits
    attention_out(call, lse.data(), again.data());
    BOOST_TEST((again == out));
    attention_grad(call, lse.data(), dout.data(), delta.data(), per_head.data(), dqkv_again.data());
    BOOST_TEST((dqkv_again == dqkv));
    if (c.bf16) {  // one term of a sum of gradients: the same sums in fp32, not rounded
      call.fp32_dqkv = true;
      std::vector<float> wide(dqkv.size());
      attention_grad(call, lse.data(), dout.data(), delta.data(), per_head.data(), wide.data());
      BOOST_TEST(worst(ref.dqkv, [&](std::size_t i) { return wide[i]; }) < tol);
      std::size_t rounded_apart = 0;
      for (std::size_t i = 0; i < wide.size(); ++i) rounded_apart += float_to_bf16(wide[i]) != dqkv.h[i];
      BOOST_TEST(rounded_apart == 0u);
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(fp32_matches_float64_at_context_lengths_inside_and_across_blocks_and_chunks) {
  check({.N = 2, .T = 5, .H = 2, .KV = 2, .D = 8});
  check({.N = 1, .T = 64, .H = 3, .KV = 3, .D = 16});
  check({.N = 2, .T = 150, .H = 4, .KV = 2, .D = 16});
  check({.N = 1, .T = 300, .H = 2, .KV = 1, .D = 64});
}

BOOST_AUTO_TEST_CASE(dropout_on_the_probabilities_uses_the_counter_hash) {
  check({.N = 2, .T = 130, .H = 2, .KV = 2, .D = 16, .p = 0.3});
  check({.N = 1, .T = 70, .H = 6, .KV = 2, .D = 32, .p = 0.1});
}

BOOST_AUTO_TEST_CASE(bf16_matches_float64_of_the_same_inputs) {
  check({.N = 1, .T = 200, .H = 4, .KV = 2, .D = 32, .bf16 = true});
  check({.N = 2, .T = 66, .H = 2, .KV = 2, .D = 64, .bf16 = true, .p = 0.2});
  check({.N = 4, .T = 6, .H = 3, .KV = 3, .D = 4, .bf16 = true});  // the test models' tiny heads
  check({.N = 3, .T = 5, .H = 6, .KV = 2, .D = 2, .bf16 = true});
}

namespace {
__attribute__((target("avx512f"))) void exp_avx512(const float *x, float *out) {
  _mm512_storeu_ps(out, exp_float::exp_of(_mm512_loadu_ps(x)));
}
__attribute__((target("avx2,fma"))) void exp_avx2(const float *x, float *out) {
  for (int h = 0; h < 16; h += 8) _mm256_storeu_ps(out + h, exp_float::exp_of(_mm256_loadu_ps(x + h)));
}
}  // namespace

// The probabilities' exp (runtime/exp_float.h) on a sample of every 61st float in [-87, 88):
// within 0.57 ulp of the double exp (its header says so of every float: an exhaustive run saw
// 0.562 ulp, 7.8e-4 not the nearest), the vector forms this CPU has give the scalar's bits, and
// below -87 (the mask's -inf too) it is exactly 0.
BOOST_AUTO_TEST_CASE(the_float_exp_is_within_its_stated_ulps_and_the_same_bits_in_every_form) {
  const bool avx512 = __builtin_cpu_supports("avx512f"),
             avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  std::vector<float> xs;  // by bit pattern: -0 down to -87, then 0 up to 88
  for (std::uint32_t u = 0x80000000u; u <= std::bit_cast<std::uint32_t>(-87.f); u += 61)
    xs.push_back(std::bit_cast<float>(u));
  for (std::uint32_t u = 0; u < std::bit_cast<std::uint32_t>(88.f); u += 61) xs.push_back(std::bit_cast<float>(u));
  xs.insert(xs.end(), {-87.00001f, -100.f, -std::numeric_limits<float>::infinity()});
  while (xs.size() % 16) xs.push_back(1.f);
  double worst_ulps = 0;
  std::size_t vector_apart = 0, not_nearest = 0;
  for (std::size_t i = 0; i < xs.size(); i += 16) {
    float scalar[16], wide[16];
    for (int l = 0; l < 16; ++l) scalar[l] = exp_float::exp_of(xs[i + l]);
    if (avx512) {
      exp_avx512(&xs[i], wide);
      vector_apart += std::memcmp(scalar, wide, sizeof scalar) != 0;
    }
    if (avx2) {
      exp_avx2(&xs[i], wide);
      vector_apart += std::memcmp(scalar, wide, sizeof scalar) != 0;
    }
    for (int l = 0; l < 16; ++l) {
      const float x = xs[i + l];
      if (x < -87.f) {
        BOOST_TEST(std::bit_cast<std::uint32_t>(scalar[l]) == 0u);
        continue;
      }
      const double exact = std::exp(double(x));
      const float nearest = float(exact);
      const double ulp = double(std::nextafter(nearest, INFINITY)) - double(nearest);
      worst_ulps = testing::worse(worst_ulps, std::abs(double(scalar[l]) - exact) / ulp);
      not_nearest += scalar[l] != nearest;
    }
  }
  BOOST_TEST_MESSAGE(xs.size() << " floats: worst " << worst_ulps << " ulp, " << not_nearest << " not the nearest");
  BOOST_TEST(worst_ulps <= 0.57);
  BOOST_TEST(double(not_nearest) <= 1e-3 * double(xs.size()));
  BOOST_TEST(vector_apart == 0u);
}
