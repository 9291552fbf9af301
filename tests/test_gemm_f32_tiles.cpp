// The attention's fp32 tile kernel (runtime/gemm_f32_tiles.cpp) against its own definition, bit for
// bit: each element of A B the chain fma(A(i, k-1), B(k-1, j), ... A(i, 0) B(0, j)) in order, times
// alpha or added to c, computed here in scalar std::fma. Shapes on and off its 4 x 64 tiles (rows
// past the edge, masked last vectors), both layouts of a, padded leading dimensions (c's padding
// left alone); and transpose_f32, exactly. Skipped on a CPU without AVX-512, where the attention
// does not call it.
#include <boost/test/unit_test.hpp>

#include "gemm_f32_tiles.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

using namespace remat;

namespace {

const auto needs_kernel = boost::unit_test::precondition(
    [](boost::unit_test::test_unit_id) { return boost::test_tools::assertion_result(gemm_f32_tiles_available()); });

}  // namespace

BOOST_AUTO_TEST_CASE(every_element_is_its_fma_chain, *needs_kernel) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  const int shapes[][3] = {{1, 1, 1},     {4, 16, 1},    {5, 17, 3},  {64, 128, 64}, {64, 64, 128},
                           {128, 64, 64}, {61, 100, 37}, {3, 130, 7}, {7, 65, 2},    {33, 1, 129}};
  int cases = 0;
  for (auto [m, n, k] : shapes)
    for (int t = 0; t < 4; ++t) {
      const bool trans_a = t & 1, add = t & 2;
      const float alpha = add ? 1.f : 0.125f;
      const int pad = t + 1, lda = (trans_a ? m : k) + pad, ldb = n + pad, ldc = n + pad;
      std::vector<float> a(std::size_t(lda) * (trans_a ? k : m)), b(std::size_t(ldb) * k), c(std::size_t(ldc) * m);
      for (auto *v : {&a, &b, &c})
        for (float &x : *v) x = u(rng);
      std::vector<float> want = c;
      for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
          const auto at_a = [&](int q) { return trans_a ? a[std::size_t(q) * lda + i] : a[std::size_t(i) * lda + q]; };
          float sum = at_a(0) * b[j];
          for (int q = 1; q < k; ++q) sum = std::fma(at_a(q), b[std::size_t(q) * ldb + j], sum);
          float &w = want[std::size_t(i) * ldc + j];
          w = add ? w + sum : alpha * sum;
        }
      gemm_f32_tiles(trans_a, m, n, k, alpha, a.data(), lda, b.data(), ldb, add, c.data(), ldc);
      BOOST_TEST_INFO("m " << m << " n " << n << " k " << k << " trans_a " << trans_a << " add " << add);
      BOOST_TEST(std::memcmp(c.data(), want.data(), c.size() * sizeof(float)) == 0);
      ++cases;
    }
  BOOST_TEST(cases == 40);
}

BOOST_AUTO_TEST_CASE(transpose_moves_every_element, *needs_kernel) {
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto [rows, cols] : {std::pair{1, 1}, {16, 16}, {17, 33}, {128, 64}, {5, 100}}) {
    const int ldx = cols + 3, ldt = rows + 2;
    std::vector<float> x(std::size_t(ldx) * rows), to(std::size_t(ldt) * cols, -7.f), want = to;
    for (float &v : x) v = u(rng);
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j) want[std::size_t(j) * ldt + i] = x[std::size_t(i) * ldx + j];
    transpose_f32(rows, cols, x.data(), ldx, to.data(), ldt);
    BOOST_TEST_INFO("rows " << rows << " cols " << cols);
    BOOST_TEST(std::memcmp(to.data(), want.data(), to.size() * sizeof(float)) == 0);
  }
}
