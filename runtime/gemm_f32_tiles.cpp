// The attention's fp32 tiles (gemm_f32_tiles.h): tiles of 4 rows by up to 64 columns (four vectors,
// the last masked), 16 accumulators, each a's element broadcast from where it lies and each b row's
// vectors loaded once for the tile's 4 rows. MKL's sgemm packs both operands on every call, which
// at the attention's shapes (64 x 128 x 64) is a sixth of its time.
#include "gemm_f32_tiles.h"

#include "cpu_variant.h"
#include "transpose16.h"

#include <immintrin.h>

#include <algorithm>
#include <cstddef>

namespace remat {

namespace {

constexpr int tile_rows = 4, lanes = 16;

// c[rows <= 4, columns < 16 vectors] of one tile; a row past the edge repeats the last one (computed, not stored).
template <int vectors>
__attribute__((target("avx512f"))) void tile(bool trans_a, int rows, __mmask16 last, int k, float alpha, const float *a,
                                             int lda, const float *b, int ldb, bool add, float *c, int ldc) {
  __m512 acc[tile_rows][vectors];
  std::ptrdiff_t row_step[tile_rows], depth_step = trans_a ? lda : 1;  // a's element (r, q)
  for (int r = 0; r < tile_rows; ++r) {
    const int row = std::min(r, rows - 1);
    row_step[r] = trans_a ? row : std::ptrdiff_t(row) * lda;
  }
  __mmask16 mask[vectors];
  for (int v = 0; v < vectors; ++v) mask[v] = v == vectors - 1 ? last : __mmask16(0xffff);
#pragma GCC unroll 4
  for (int r = 0; r < tile_rows; ++r) {
    const __m512 ar = _mm512_set1_ps(a[row_step[r]]);
#pragma GCC unroll 4
    for (int v = 0; v < vectors; ++v) acc[r][v] = _mm512_mul_ps(ar, _mm512_maskz_loadu_ps(mask[v], b + v * lanes));
  }
  for (int q = 1; q < k; ++q) {
    __m512 bq[vectors];
    const float *bk = b + std::ptrdiff_t(q) * ldb, *aq = a + q * depth_step;
#pragma GCC unroll 4
    for (int v = 0; v < vectors; ++v) bq[v] = _mm512_maskz_loadu_ps(mask[v], bk + v * lanes);
#pragma GCC unroll 4
    for (int r = 0; r < tile_rows; ++r) {
      const __m512 ar = _mm512_set1_ps(aq[row_step[r]]);
#pragma GCC unroll 4
      for (int v = 0; v < vectors; ++v) acc[r][v] = _mm512_fmadd_ps(ar, bq[v], acc[r][v]);
    }
  }
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < vectors; ++v) {
      float *at = c + std::ptrdiff_t(r) * ldc + v * lanes;
      const __m512 sum =
          add ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask[v], at), acc[r][v]) : _mm512_mul_ps(scale, acc[r][v]);
      _mm512_mask_storeu_ps(at, mask[v], sum);
    }
}

}  // namespace

__attribute__((target("avx512f"))) void transpose_f32(int rows, int cols, const float *x, int ldx, float *to, int ldt) {
  for (int i0 = 0; i0 < rows; i0 += lanes)
    for (int j0 = 0; j0 < cols; j0 += lanes) {
      const int n = std::min(lanes, rows - i0), m = std::min(lanes, cols - j0);
      __m512i block[lanes];
      for (int i = 0; i < lanes; ++i)
        block[i] = i < n ? _mm512_maskz_loadu_epi32(__mmask16((1u << m) - 1), x + std::ptrdiff_t(i0 + i) * ldx + j0)
                         : _mm512_setzero_si512();
      transpose16(block);
      for (int j = 0; j < m; ++j)
        _mm512_mask_storeu_epi32(to + std::ptrdiff_t(j0 + j) * ldt + i0, __mmask16((1u << n) - 1), block[j]);
    }
}

bool gemm_f32_tiles_available() { return cpu_avx512(); }

void gemm_f32_tiles(bool trans_a, int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                    bool add, float *c, int ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {  // an empty sum: c stays, or becomes 0
    if (!add)
      for (int i = 0; i < m; ++i) std::fill(c + std::ptrdiff_t(i) * ldc, c + std::ptrdiff_t(i) * ldc + n, 0.f);
    return;
  }
  using Tile = void (*)(bool, int, __mmask16, int, float, const float *, int, const float *, int, bool, float *, int);
  constexpr Tile tiles[] = {tile<1>, tile<2>, tile<3>, tile<4>};
  for (int j = 0; j < n; j += 4 * lanes) {
    const int columns = std::min(4 * lanes, n - j), vectors = (columns + lanes - 1) / lanes;
    const __mmask16 last = __mmask16((1u << (columns - (vectors - 1) * lanes)) - 1);
    for (int i = 0; i < m; i += tile_rows) {
      const float *at = trans_a ? a + i : a + std::ptrdiff_t(i) * lda;
      tiles[vectors - 1](trans_a, std::min(tile_rows, m - i), last, k, alpha, at, lda, b + j, ldb, add,
                         c + std::ptrdiff_t(i) * ldc + j, ldc);
    }
  }
}

}  // namespace remat
