// exp(x) in float without a library call, for the CPU attention's probabilities: a scalar form
// (compiled for every CPU), a form of 16 lanes for AVX-512 that looks its table up with one
// permute, and one of 8 lanes for AVX2 (two permutes and a blend). All run the same IEEE
// operations in the same order (fused multiply-adds explicit, nothing else contracted), so every
// CPU gives the same bits.
//
// x = (16 k + j) ln 2 / 16 + r with |r| <= ln 2 / 32 (ln 2 / 16 in two parts), e^r - 1 = q by its
// Taylor polynomial of degree 4 (truncation below 4e-11 of q), 2^(j / 16) from a table as a float
// pair hi + lo, and the result hi + (lo + hi q) rounded once, times 2^k: within 0.57 ulp of exp(x)
// and the nearest float for all but 7.8e-4 of the floats in [-87, 88) (every one checked against
// the double exp). Below -87 (and -inf, the mask) exactly 0, so that no result is subnormal and
// the bits do not depend on a thread's denormal mode; above 88 exp(88).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace remat::exp_float {

struct Table {
  float hi[16], lo[16];
};
// 2^(j / 16), j = 0..15: hi the nearest float, lo the nearest float to the rest (of the double)
inline constexpr Table table = [] {
  Table t{};
  constexpr double exact[16] = {1.0,
                                1.0442737824274138403219664787399290087846,
                                1.0905077326652576592070106557607079789927,
                                1.1387886347566916537038302838415112547202,
                                1.1892071150027210667174999705604759152929,
                                1.2418578120734840485936774687265956055110,
                                1.2968395546510096659337541177924511598353,
                                1.3542555469368927282980147401407028043432,
                                1.4142135623730950488016887242096980785696,
                                1.4768261459394993113869074803740499239236,
                                1.5422108254079408236122918620907348413068,
                                1.6104903319492543081795206673574005834594,
                                1.6817928305074290860622509524664297900800,
                                1.7562521603732994831121606193753132212943,
                                1.8340080864093424634870831895882888560773,
                                1.9152065613971472938726112702958308878502};
  for (int j = 0; j < 16; ++j) {
    t.hi[j] = float(exact[j]);
    t.lo[j] = float(exact[j] - double(t.hi[j]));
  }
  return t;
}();
inline constexpr float lowest = -87.f, highest = 88.f;
inline constexpr float sixteen_over_ln2 = 23.083120654223414f;
inline constexpr float round_magic = 12582912.f;  // 1.5 * 2^23: (v + it) - it rounds v to a whole number
inline constexpr float ln2_16_hi = 0.043321698784996582f;
inline constexpr float ln2_16_lo = float(0.043321698784996582 - double(0.043321698784996582f));
inline constexpr float c2 = 0.5f, c3 = 1.f / 6, c4 = 1.f / 24;

[[gnu::always_inline]] inline float exp_of(float x) {
#pragma clang fp contract(off)
  const float y = std::min(std::max(x, lowest), highest);
  const float kf = (y * sixteen_over_ln2 + round_magic) - round_magic;
  const float r = std::fma(kf, -ln2_16_lo, std::fma(kf, -ln2_16_hi, y));
  const float q = std::fma(std::fma(std::fma(c4, r, c3), r, c2), r, 1.f) * r;
  const int k = int(kf), j = k & 15;
  const float m = table.hi[j] + std::fma(table.hi[j], q, table.lo[j]);
  const float scaled = std::bit_cast<float>(std::bit_cast<std::int32_t>(m) + (k >> 4) * (1 << 23));
  return x < lowest ? 0.f : scaled;
}

#if defined(__x86_64__)
[[gnu::always_inline, gnu::target("avx512f")]] inline __m512 exp_of(__m512 x) {
  const __m512 y = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(lowest)), _mm512_set1_ps(highest));
  const __m512 magic = _mm512_set1_ps(round_magic);
  const __m512 kf = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(y, _mm512_set1_ps(sixteen_over_ln2)), magic), magic);
  const __m512 r = _mm512_fmadd_ps(kf, _mm512_set1_ps(-ln2_16_lo), _mm512_fmadd_ps(kf, _mm512_set1_ps(-ln2_16_hi), y));
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(c4), r, _mm512_set1_ps(c3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512 q = _mm512_mul_ps(p, r);
  const __m512i k = _mm512_cvtps_epi32(kf);                               // kf is whole: exact
  const __m512 hi = _mm512_permutexvar_ps(k, _mm512_loadu_ps(table.hi));  // lanes k mod 16
  const __m512 lo = _mm512_permutexvar_ps(k, _mm512_loadu_ps(table.lo));
  const __m512 m = _mm512_add_ps(hi, _mm512_fmadd_ps(hi, q, lo));
  const __m512i scaled = _mm512_add_epi32(_mm512_castps_si512(m), _mm512_slli_epi32(_mm512_srai_epi32(k, 4), 23));
  const __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_set1_ps(lowest), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(scaled), below, _mm512_setzero_ps());
}

// A 16-entry table looked up in 8 lanes: each half permuted, then the half bit 3 of k picks.
[[gnu::always_inline, gnu::target("avx2,fma")]] inline __m256 lookup(const float *t, __m256i k) {
  const __m256 low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(t), k);
  const __m256 high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(t + 8), k);
  return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(k, 28)));
}
[[gnu::always_inline, gnu::target("avx2,fma")]] inline __m256 exp_of(__m256 x) {
  const __m256 y = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(lowest)), _mm256_set1_ps(highest));
  const __m256 magic = _mm256_set1_ps(round_magic);
  const __m256 kf = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_set1_ps(sixteen_over_ln2)), magic), magic);
  const __m256 r = _mm256_fmadd_ps(kf, _mm256_set1_ps(-ln2_16_lo), _mm256_fmadd_ps(kf, _mm256_set1_ps(-ln2_16_hi), y));
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(c4), r, _mm256_set1_ps(c3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256 q = _mm256_mul_ps(p, r);
  const __m256i k = _mm256_cvtps_epi32(kf);
  const __m256 hi = lookup(table.hi, k), lo = lookup(table.lo, k);
  const __m256 m = _mm256_add_ps(hi, _mm256_fmadd_ps(hi, q, lo));
  const __m256i scaled = _mm256_add_epi32(_mm256_castps_si256(m), _mm256_slli_epi32(_mm256_srai_epi32(k, 4), 23));
  const __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(lowest), _CMP_LT_OQ);
  return _mm256_andnot_ps(below, _mm256_castsi256_ps(scaled));
}
#endif

}  // namespace remat::exp_float
