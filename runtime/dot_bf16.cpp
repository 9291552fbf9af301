// A bf16 GEMM on AVX512_BF16's dot product (vdpbf16ps: two bf16 products added to an fp32 lane), for
// CPUs that have it but no AMX: MKL's cblas_gemm_bf16bf16f32 runs there at the fp32 rate (it widens the
// operands), this one at up to twice it. Blocked as BLIS blocks: b packed into micro-panels of 16
// columns, each a run of k-pairs (32-bit words holding elements k and k + 1), zero-padded past the
// edges; a read in place where its rows hold their k-pairs as whole words (row-major, even depth),
// else packed the same way into micro-panels of 16 rows; a tile of fp32 accumulators (4 x 64 where
// the width is whole 64s, else 8 x 48 where 48 columns remain, else 16 x 16) sums a panel's whole
// depth in order, each lane its element's k-pairs in the same order on every tile, so the sum's
// order depends on the shape only (a recompute gets the same bits).
#include "cpu_variant.h"
#include "dot_bf16.h"
#include "transpose16.h"

#include <immintrin.h>

#include <cpuid.h>
#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <vector>

namespace remat {

namespace {

constexpr int tile = 16;  // rows of an a micro-panel, columns of a b micro-panel

struct DotFeatures {
  bool dot = false, amx = false;  // AVX-512 (F, BW, VL) with AVX512_BF16, the OS saving zmm; AMX_BF16
};
DotFeatures cpu_dot_features() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return {};
  const bool avx512 = (ebx >> 16) & 1 && (ebx >> 30) & 1 && (ebx >> 31) & 1;  // F, BW, VL
  const bool amx_bf16 = (edx >> 22) & 1;
  if (!avx512 || !__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return {};
  const bool avx512_bf16 = (eax >> 5) & 1;
  unsigned xcr0_lo, xcr0_hi;  // the OS saves the zmm registers
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  return {avx512_bf16 && (xcr0_lo & 0xe6) == 0xe6, amx_bf16};
}

// Packed panels: a as [row tile][k-pair][16 rows], b as [column tile][k-pair][16 columns], 32-bit words.
struct Packed {
  std::vector<std::uint32_t> a, b;
};
Packed &packed() {
  thread_local Packed p{std::vector<std::uint32_t>(std::size_t(dot_bf16_max_m) * dot_bf16_max_k / 2),
                        std::vector<std::uint32_t>(std::size_t(dot_bf16_max_n) * dot_bf16_max_k / 2)};
  return p;
}

// The element (row, depth) of an operand stored row-major with leading dimension ld, or transposed.
struct Operand {
  const std::uint16_t *p;
  int ld;
  bool trans;
  std::uint32_t at(int row, int depth) const {
    return trans ? p[std::size_t(depth) * ld + row] : p[std::size_t(row) * ld + depth];
  }
};

// One micro-panel: 16 lines (rows of a, columns of b) from `first`, `lines` of them real (the rest
// zero), k-pairs 0 .. k/2 rounded up. Lines stored along the depth (a, or b transposed) are read
// a pair (one 32-bit word) at a time, 16 pairs of 16 lines transposed in registers; lines stored across the depth
// are two rows of 16 elements interleaved.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void pack(const Operand &op, int first, int lines, int k,
                                                               std::uint32_t *to) {
  const int pairs = k / 2;
  const __mmask16 live = __mmask16((1u << lines) - 1);
  if (!op.trans && op.ld % 2 == 0 && reinterpret_cast<std::uintptr_t>(op.p) % 4 == 0) {
    const auto *words = reinterpret_cast<const std::uint32_t *>(op.p + std::size_t(first) * op.ld);
    for (int q0 = 0; q0 < pairs; q0 += tile) {  // 16 lines x 16 pairs, transposed in registers
      const int count = std::min(tile, pairs - q0);
      __m512i block[tile];
      for (int l = 0; l < tile; ++l)
        block[l] = l < lines ? _mm512_maskz_loadu_epi32(__mmask16((1u << count) - 1),
                                                        words + std::size_t(l) * (op.ld / 2) + q0)
                             : _mm512_setzero_si512();
      transpose16(block);
      for (int q = 0; q < count; ++q) _mm512_storeu_si512(to + tile * (q0 + q), block[q]);
    }
  } else if (op.trans) {
    for (int q = 0; q < pairs; ++q) {
      const std::uint16_t *even = op.p + std::size_t(2 * q) * op.ld + first, *odd = even + op.ld;
      if (q + 8 < pairs) {  // the rows lie far apart: fetched ahead, not one cache miss at a time
        _mm_prefetch(reinterpret_cast<const char *>(even + 16 * std::size_t(op.ld)), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(odd + 16 * std::size_t(op.ld)), _MM_HINT_T0);
      }
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, even));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, odd));
      _mm512_storeu_si512(to + tile * q, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  } else {
    for (int q = 0; q < pairs; ++q)
      for (int l = 0; l < tile; ++l)
        to[tile * q + l] = l < lines ? op.at(first + l, 2 * q) | op.at(first + l, 2 * q + 1) << 16 : 0;
  }
  if (k % 2)
    for (int l = 0; l < tile; ++l) to[tile * pairs + l] = l < lines ? op.at(first + l, k - 1) : 0;
}

// c[rows, 16 masked columns] = (c +) the tile's product over `pairs` k-pairs.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void micro_tile(int pairs, const std::uint32_t *a,
                                                                                const std::uint32_t *b, float *c,
                                                                                int ldc, int rows, __mmask16 cols,
                                                                                bool add) {
  __m512 acc[tile];
#pragma GCC unroll 16
  for (int r = 0; r < tile; ++r) acc[r] = _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r)  // c's rows lie far apart: in cache by the time the sums are done
    _mm_prefetch(reinterpret_cast<const char *>(c + std::size_t(r) * ldc), _MM_HINT_T0);
  for (int q = 0; q < pairs; ++q) {
    const __m512bh bq = (__m512bh)_mm512_loadu_si512(b + tile * q);
#pragma GCC unroll 16
    for (int r = 0; r < tile; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(int(a[tile * q + r])), bq);
  }
  for (int r = 0; r < rows; ++r) {
    float *row = c + std::size_t(r) * ldc;
    const __m512 sum = add ? _mm512_add_ps(_mm512_maskz_loadu_ps(cols, row), acc[r]) : acc[r];
    _mm512_mask_storeu_ps(row, cols, sum);
  }
}

// c[rows <= lines, 16 panels columns] = (c +) the product of `lines` rows of a (a.row[r] their
// k-pairs, a.step words apart: a packed micro-panel's rows, or a's own rows where it lies row-major)
// and `panels` whole b micro-panels (b, b + panel, ...): lines x panels accumulators, each pair's b
// vectors loaded once for all the lines. 8 x 48 (24 accumulators) and 4 x 64 (16, for widths of
// whole 64s, as the attention's 64 and 128). Each lane sums its element's k-pairs in the same
// order as micro_tile: the same bits.
template <int lines>
struct ARows {
  const std::uint32_t *row[lines];
  int step;
};
template <int lines, int panels, int step>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void wide_tile(int pairs, const ARows<lines> &a,
                                                                               const std::uint32_t *b,
                                                                               std::size_t panel, float *c, int ldc,
                                                                               int rows, bool add) {
  __m512 acc[lines][panels];
#pragma GCC unroll 8
  for (int r = 0; r < lines; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < panels; ++p) acc[r][p] = _mm512_setzero_ps();
  const std::uint32_t *row[lines];
#pragma GCC unroll 8
  for (int r = 0; r < lines; ++r) row[r] = a.row[r];
  for (int q = 0; q < pairs; ++q) {
    __m512bh bq[panels];
#pragma GCC unroll 4
    for (int p = 0; p < panels; ++p) bq[p] = (__m512bh)_mm512_loadu_si512(b + p * panel + tile * q);
#pragma GCC unroll 8
    for (int r = 0; r < lines; ++r) {
      const __m512bh ab = (__m512bh)_mm512_set1_epi32(int(row[r][step * q]));
#pragma GCC unroll 4
      for (int p = 0; p < panels; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], ab, bq[p]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int p = 0; p < panels; ++p) {
      float *at = c + std::size_t(r) * ldc + p * tile;
      _mm512_storeu_ps(at, add ? _mm512_add_ps(_mm512_loadu_ps(at), acc[r][p]) : acc[r][p]);
    }
}

// Where a's k-pairs come from: its packed micro-panels, or its own rows (row-major, an even
// leading dimension and depth, 4-byte aligned: a row's pairs are whole 32-bit words in order).
struct ASource {
  const std::uint32_t *words;
  int ld_words;  // 0: packed
  int m;
  template <int lines>
  ARows<lines> rows(int i, int pairs) const {  // rows i .. i + lines (past m: row i, read and dropped)
    ARows<lines> a{{}, ld_words ? 1 : tile};
    for (int r = 0; r < lines; ++r)
      a.row[r] = ld_words ? words + std::size_t(i + r < m ? i + r : i) * ld_words
                          : words + std::size_t(i / tile) * tile * pairs + i % tile + r;
    return a;
  }
};

// Columns [j, j + lines x 16 panels) of c on wide tiles, every row.
template <int lines, int panels>
void wide_columns(int m, int j, int pairs, const ASource &a, DotPackedB b, bool add, float *c, int ldc) {
  const std::uint32_t *bp = b.columns_from(j).words;
  const std::size_t panel = std::size_t(tile) * b.stride;
  for (int i = 0; i < m; i += lines) {
    const ARows<lines> rows = a.rows<lines>(i, pairs);
    float *ci = c + std::size_t(i) * ldc + j;
    if (rows.step == 1)
      wide_tile<lines, panels, 1>(pairs, rows, bp, panel, ci, ldc, std::min(lines, m - i), add);
    else
      wide_tile<lines, panels, tile>(pairs, rows, bp, panel, ci, ldc, std::min(lines, m - i), add);
  }
}

}  // namespace

bool dot_bf16_available() {
  static const bool available = dot_bf16_runs() && !cpu_dot_features().amx && !cpu_avx2_forced();
  return available;
}
bool dot_bf16_runs() {
  static const bool runs = cpu_dot_features().dot;
  return runs;
}

void dot_bf16_pack_b(bool trans_b, int n, int k, const std::uint16_t *b, int ldb, std::uint32_t *to) {
  // b's columns are a's rows when b is stored [n, k] (trans_b), and its transpose when stored [k, n]
  const Operand bo{b, ldb, !trans_b};
  const int pairs = (k + 1) / 2;
  for (int j = 0; j < n; j += tile) pack(bo, j, std::min(tile, n - j), k, to + std::size_t(j) * pairs);
}

void dot_bf16_gemm_packed(bool trans_a, int m, int n, int k, const std::uint16_t *a, int lda, DotPackedB b, bool add,
                          float *c, int ldc) {
  if (m > dot_bf16_max_m || k > dot_bf16_max_k || (k + 1) / 2 > b.pairs)
    throw std::runtime_error("dot_bf16_gemm: a panel larger than the packing buffers or than b's packed depth");
  Packed &p = packed();
  const int pairs = (k + 1) / 2;
  const int wide = n % (4 * tile) == 0 ? n : n - n % (3 * tile);  // columns on wide tiles
  const bool direct = !trans_a && lda % 2 == 0 && k % 2 == 0 && reinterpret_cast<std::uintptr_t>(a) % 4 == 0;
  if (!direct || wide < n)  // a packed: it is not read in place, or 16 x 16 tiles take the last columns
    for (int i = 0; i < m; i += tile)
      pack(Operand{a, lda, trans_a}, i, std::min(tile, m - i), k, p.a.data() + std::size_t(i) * pairs);
  const ASource as =
      direct ? ASource{reinterpret_cast<const std::uint32_t *>(a), lda / 2, m} : ASource{p.a.data(), 0, m};
  int j = 0;
  if (n % (4 * tile) == 0)  // whole 4 x 64 tiles
    for (; j < n; j += 4 * tile) wide_columns<4, 4>(m, j, pairs, as, b, add, c, ldc);
  for (; j + 3 * tile <= n; j += 3 * tile) wide_columns<8, 3>(m, j, pairs, as, b, add, c, ldc);
  for (; j < n; j += tile) {
    const __mmask16 cols = __mmask16((1u << std::min(tile, n - j)) - 1);
    for (int i = 0; i < m; i += tile)
      micro_tile(pairs, p.a.data() + std::size_t(i) * pairs, b.columns_from(j).words, c + std::size_t(i) * ldc + j, ldc,
                 std::min(tile, m - i), cols, add);
  }
}

void dot_bf16_gemm(bool trans_a, bool trans_b, int m, int n, int k, const std::uint16_t *a, int lda,
                   const std::uint16_t *b, int ldb, bool add, float *c, int ldc) {
  if (n > dot_bf16_max_n || k > dot_bf16_max_k)
    throw std::runtime_error("dot_bf16_gemm: a panel larger than the packing buffers");
  std::uint32_t *packed_b = packed().b.data();
  dot_bf16_pack_b(trans_b, n, k, b, ldb, packed_b);
  dot_bf16_gemm_packed(trans_a, m, n, k, a, lda, {packed_b, (k + 1) / 2, (k + 1) / 2}, add, c, ldc);
}

}  // namespace remat
