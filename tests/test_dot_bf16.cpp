// The bf16 GEMM on AVX512_BF16's dot product (runtime/dot_bf16.cpp) against a float64 product of the
// same bf16 operands: every transpose case, shapes on and off its 16 x 16 and 8 x 48 tiles, odd depths (a last
// k-pair half zero), odd leading dimensions (the packing's scalar path), accumulation into c, and a
// repeated call's bits. Skipped (ctest's skip code) on a CPU without AVX512_BF16; run on CPUs with
// AMX too, where the host GEMMs use MKL's AMX kernels instead (the attention and the bands do not
// call it there, but a kernel that runs is checked).
//
// Limit, per element: the products of bf16 values are exact in fp32, so the only error is the
// rounding of k fp32 additions (k + 1 with c added), each at most u = 2^-24 of the running sum,
// which is at most sum |a b| (+ |c|): (k + 1) u (sum |a b| + |c|). A wrong pair (a swapped or
// dropped element) is off by a whole product, far above it.
#include <boost/test/unit_test.hpp>

#include "compare.h"

#include "bf16.h"
#include "dot_bf16.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

using namespace remat;

namespace {

struct Case {
  int m, n, k;
  bool trans_a, trans_b, add;
  int pad;  // added to every leading dimension (odd: the packing's scalar path)
};

double check(const Case &c, std::mt19937 &rng) {  // the worst error, of its limit
  std::uniform_real_distribution<float> u(-1, 1);
  const int lda = (c.trans_a ? c.m : c.k) + c.pad, ldb = (c.trans_b ? c.k : c.n) + c.pad, ldc = c.n + c.pad;
  std::vector<std::uint16_t> a(std::size_t(lda) * (c.trans_a ? c.k : c.m)),
      b(std::size_t(ldb) * (c.trans_b ? c.n : c.k));
  for (auto &x : a) x = float_to_bf16(u(rng));
  for (auto &x : b) x = float_to_bf16(u(rng));
  std::vector<float> c0(std::size_t(ldc) * c.m);
  for (auto &x : c0) x = u(rng);
  auto at_a = [&](int i, int p) {
    return double(bf16_to_float(c.trans_a ? a[std::size_t(p) * lda + i] : a[std::size_t(i) * lda + p]));
  };
  auto at_b = [&](int p, int j) {
    return double(bf16_to_float(c.trans_b ? b[std::size_t(j) * ldb + p] : b[std::size_t(p) * ldb + j]));
  };
  std::vector<float> out = c0, again = c0;
  dot_bf16_gemm(c.trans_a, c.trans_b, c.m, c.n, c.k, a.data(), lda, b.data(), ldb, c.add, out.data(), ldc);
  dot_bf16_gemm(c.trans_a, c.trans_b, c.m, c.n, c.k, a.data(), lda, b.data(), ldb, c.add, again.data(), ldc);
  BOOST_TEST_INFO("m " << c.m << " n " << c.n << " k " << c.k << " trans_a " << c.trans_a << " trans_b " << c.trans_b
                       << " add " << c.add << " pad " << c.pad);
  BOOST_TEST(std::memcmp(out.data(), again.data(), out.size() * sizeof(float)) == 0);
  double worst = 0;  // error / limit
  for (int i = 0; i < c.m; ++i)
    for (int j = 0; j < c.n; ++j) {
      double sum = c.add ? c0[std::size_t(i) * ldc + j] : 0, scale = std::abs(sum);
      for (int p = 0; p < c.k; ++p) sum += at_a(i, p) * at_b(p, j), scale += std::abs(at_a(i, p) * at_b(p, j));
      const double limit = (c.k + 1) * std::ldexp(1.0, -24) * scale + 1e-30;
      worst = testing::worse(worst, std::abs(out[std::size_t(i) * ldc + j] - sum) / limit);
    }
  for (int i = 0; i < c.m; ++i)  // c's padding is left alone
    for (int j = c.n; j < ldc; ++j) BOOST_TEST(out[std::size_t(i) * ldc + j] == c0[std::size_t(i) * ldc + j]);
  BOOST_TEST(worst <= 1.0);
  return worst;
}

}  // namespace

BOOST_AUTO_TEST_CASE(products_within_fp32_rounding, *boost::unit_test::precondition([](boost::unit_test::test_unit_id) {
                       return boost::test_tools::assertion_result(dot_bf16_runs());
                     })) {
  std::mt19937 rng(3);
  const int shapes[][3] = {{1, 1, 1},      {16, 16, 2},     {17, 33, 3},   {100, 7, 64},
                           {37, 500, 511}, {256, 512, 512}, {64, 128, 64}, {255, 511, 510}};
  double worst = 0;
  for (auto [m, n, k] : shapes)
    for (int t = 0; t < 4; ++t)
      for (int pad : {0, 1, 2})
        worst = testing::worse(worst, check({m, n, k, bool(t & 1), bool(t & 2), bool((t + pad) & 1), pad}, rng));
  std::printf("worst error: %.3g of the limit\n", worst);
}

// Widths of whole 64s run on 4 x 64 tiles, else whole 48-column blocks on 8 x 48 tiles, the rest
// on 16 x 16 tiles; each element's k-pairs are summed in the same order on all three, so a product
// computed 64 or 48 columns at a time and the same product computed 16 columns a call have the
// same bits.
BOOST_AUTO_TEST_CASE(wide_tiles_give_the_bits_of_narrow_ones,
                     *boost::unit_test::precondition([](boost::unit_test::test_unit_id) {
                       return boost::test_tools::assertion_result(dot_bf16_runs());
                     })) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto [m, k] : {std::pair{8, 64}, {13, 511}, {16, 2}, {40, 300}, {256, 512}})
    for (int t = 0; t < 8; ++t) {
      const bool trans_a = t & 1, trans_b = t & 2, add = k % 2;
      const int n = t & 4 ? 128 : 96, lda = trans_a ? m : k, ldb = trans_b ? k : n;
      std::vector<std::uint16_t> a(std::size_t(m) * k), b(std::size_t(k) * n);
      for (auto &x : a) x = float_to_bf16(u(rng));
      for (auto &x : b) x = float_to_bf16(u(rng));
      std::vector<float> wide(std::size_t(m) * n);
      for (auto &x : wide) x = u(rng);
      std::vector<float> narrow = wide;
      dot_bf16_gemm(trans_a, trans_b, m, n, k, a.data(), lda, b.data(), ldb, add, wide.data(), n);
      for (int j = 0; j < n; j += 16)
        dot_bf16_gemm(trans_a, trans_b, m, 16, k, a.data(), lda, b.data() + (trans_b ? std::size_t(j) * ldb : j), ldb,
                      add, narrow.data() + j, n);
      BOOST_TEST_INFO("m " << m << " n " << n << " k " << k << " trans_a " << trans_a << " trans_b " << trans_b);
      BOOST_TEST(std::memcmp(wide.data(), narrow.data(), wide.size() * sizeof(float)) == 0);
    }
}

// b packed once (dot_bf16_pack_b) and multiplied in parts, as the attention multiplies a chunk of
// keys packed once by each block of queries: columns from a multiple of 16 and depth from an even
// k0 (odd depths only to the packed end). Each part's bits are those of dot_bf16_gemm on the same
// operands, packed for the call.
BOOST_AUTO_TEST_CASE(packed_b_in_parts_gives_the_bits_of_whole_calls,
                     *boost::unit_test::precondition([](boost::unit_test::test_unit_id) {
                       return boost::test_tools::assertion_result(dot_bf16_runs());
                     })) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  const int N = 130, K = 127, m = 21;
  for (int t = 0; t < 4; ++t) {
    const bool trans_a = t & 1, trans_b = t & 2;
    const int lda = trans_a ? m : K, ldb = trans_b ? K : N;
    std::vector<std::uint16_t> a(std::size_t(m) * K), b(std::size_t(K) * N);
    for (auto &x : a) x = float_to_bf16(u(rng));
    for (auto &x : b) x = float_to_bf16(u(rng));
    std::vector<std::uint32_t> packed(dot_bf16_packed_words(N, K));
    dot_bf16_pack_b(trans_b, N, K, b.data(), ldb, packed.data());
    const DotPackedB whole{packed.data(), (K + 1) / 2, (K + 1) / 2};
    // {first column, columns, first depth, depth}
    for (auto [j0, n, k0, k] : {std::array{0, N, 0, K},
                                {16, 64, 0, 64},
                                {32, 98, 64, 63},
                                {112, 18, 2, 40},
                                {0, 48, 126, 1},
                                {64, 66, 10, 117}}) {
      std::vector<float> part(std::size_t(m) * n), call(part.size());
      const std::uint16_t *ap = trans_a ? a.data() + std::size_t(k0) * lda : a.data() + k0;
      const std::uint16_t *bp = trans_b ? b.data() + std::size_t(j0) * ldb + k0 : b.data() + std::size_t(k0) * ldb + j0;
      dot_bf16_gemm_packed(trans_a, m, n, k, ap, lda, whole.columns_from(j0).depth_from(k0), false, part.data(), n);
      dot_bf16_gemm(trans_a, trans_b, m, n, k, ap, lda, bp, ldb, false, call.data(), n);
      BOOST_TEST_INFO("trans_a " << trans_a << " trans_b " << trans_b << " columns " << j0 << "+" << n << " depth "
                                 << k0 << "+" << k);
      BOOST_TEST(std::memcmp(part.data(), call.data(), part.size() * sizeof(float)) == 0);
    }
  }
}
