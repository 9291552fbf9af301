// Causal self-attention on the host (attention.h): the extern stages remat_attention_lse,
// remat_attention_out, remat_attention_grad and remat_attention_grad_sum that the CPU kernels
// call, and the blocked algorithm behind them.
//
// Forward, a task per (sequence, head, group of four blocks of 64 query rows), by tiles of a block
// by a chunk of 128 keys: the scores of a tile are one GEMM (q k^T), exp(score - lse) a vectorized
// loop of its own, and the tile's share of the output one more GEMM (P v). The statistics (lse)
// are their own pass, online over the chunks, so that the output pass reads them as a recompute
// reads the saved ones. Backward in one pass over the same tiles a (sequence, query head), by
// groups of four key chunks: P rebuilt from lse as the forward built it, dP = dout v^T,
// dS = P (dP - delta) once per tile, five products (the forward's two and dv, dk, dq); the
// per-head sums go to a planned fp32 workspace, and a
// second pass adds the query heads of a group (grouped-query) and rounds. bf16: every product
// runs on AVX512_BF16's dot product where the CPU has it (runtime/dot_bf16.cpp), P and dS rounded
// to bf16 before theirs; elsewhere in MKL's sgemm on widened copies. fp32: every product on
// remat's fp32 tiles where the CPU has AVX-512 (runtime/gemm_f32_tiles.cpp; each key chunk
// transposed once for the score products), else MKL's sgemm.
#include "attention.h"

#include "bf16.h"
#include "cpu_variant.h"
#include "dot_bf16.h"
#include "exp_float.h"
#include "gemm.h"
#include "gemm_f32_tiles.h"

#include <HalideRuntime.h>
#include <immintrin.h>
#include <mkl.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>

// No contraction of a * b + c into an fma: the same bits on every CPU and vector width.
#pragma clang fp contract(off)

extern "C" char remat_halide_error[1024];

namespace remat {
namespace {

constexpr int block_rows = 64;  // query rows of a dq / out / lse task, key rows of a dk / dv task
constexpr int chunk = 128;      // positions a GEMM runs over (the other side of a task's block)
constexpr int max_head_dim = 128;
// the dot kernel takes a block by a chunk over the head's features in one call
static_assert(block_rows <= dot_bf16_max_m && chunk <= dot_bf16_max_n && max_head_dim <= dot_bf16_max_k);
constexpr int lanes = 16;  // partial sums of a row reduction (a vector's width), added in order at the end
constexpr float minus_inf = -std::numeric_limits<float>::infinity();

using Index = std::ptrdiff_t;

// A [count, D] block of one head's columns: as fp32 rows (row stride ld), the tensor itself (fp32)
// or a widened copy in `copy` (bf16); and bf16's own rows (row stride bf16_ld). A bf16 block is
// widened only without AVX512_BF16's dot product. An fp32 block a GEMM takes as b^T may also hold
// its transpose t [D, count] (row stride t_ld), made by with_transpose for the fp32 tile kernel; a
// bf16 block the dot kernel takes as b^T or b, that operand packed (with_packed).
struct Rows {
  const float *p;
  int ld;
  const std::uint16_t *bf16 = nullptr;
  int bf16_ld = 0;
  const float *t = nullptr;
  int t_ld = 0;
  DotPackedB dot_bt{}, dot_b{};  // words nullptr: not packed
};
Rows head_rows(const void *base, bool bf16, int width, Index row0, int count, int col, int D, float *copy) {
  if (!bf16) return {static_cast<const float *>(base) + row0 * width + col, width};
  const auto *src = static_cast<const std::uint16_t *>(base) + row0 * width + col;
  if (dot_bf16_available()) return {nullptr, 0, src, width};
  for (int i = 0; i < count; ++i)
    for (int d = 0; d < D; ++d) copy[i * D + d] = bf16_to_float(src[Index(i) * width + d]);
  return {copy, D, src, width};
}
// An fp32 block (bf16 == false: `to` is free, head_rows copied nothing into it) with its transpose
// in `to`, when the fp32 tile kernel runs; else the block as it is.
Rows with_transpose(Rows r, bool bf16, int count, int D, float *to) {
  if (bf16 || !gemm_f32_tiles_available()) return r;
  transpose_f32(count, D, r.p, r.ld, to, count);
  r.t = to;
  r.t_ld = count;
  return r;
}
// A bf16 block not widened (the dot kernel's), with the b operands of its products packed once
// into `space` (free: head_rows copied nothing into it; it holds count x D floats): as b^T
// (gemm_abt: the block's rows are b's columns) and as b (gemm_ab: its rows are b's depth). Each
// product of it then packs nothing; else the block as it is.
Rows with_packed(Rows r, int count, int D, float *space, bool as_bt, bool as_b) {
  if (r.p || !r.bf16) return r;
  auto *to = reinterpret_cast<std::uint32_t *>(space);
  if (as_bt) {
    dot_bf16_pack_b(true, count, D, r.bf16, r.bf16_ld, to);
    r.dot_bt = {to, (D + 1) / 2, (D + 1) / 2};
    to += dot_bf16_packed_words(count, D);
  }
  if (as_b) {
    dot_bf16_pack_b(false, D, count, r.bf16, r.bf16_ld, to);
    r.dot_b = {to, (count + 1) / 2, (count + 1) / 2};
  }
  return r;
}
// Rows `at` and on of a block (`at` a multiple of 16).
Rows at_row(Rows r, int at) {
  return {r.p ? r.p + Index(at) * r.ld : nullptr,
          r.ld,
          r.bf16 ? r.bf16 + Index(at) * r.bf16_ld : nullptr,
          r.bf16_ld,
          r.t ? r.t + at : nullptr,
          r.t_ld,
          r.dot_bt.words ? r.dot_bt.columns_from(at) : DotPackedB{},
          r.dot_b.words ? r.dot_b.depth_from(at) : DotPackedB{}};
}
// Writes a [count, D] fp32 block (row stride D) times `scale` into the head's columns of a stored
// tensor. (Compiled for AVX-512 and AVX2 too: the same products and integer rounding, the same bits.)
__attribute__((target_clones("avx512bw", "avx2", "default"))) void store_rows(const float *x, float scale, void *base,
                                                                              bool bf16, int width, Index row0,
                                                                              int count, int col, int D) {
  for (int i = 0; i < count; ++i) {
    const Index at = (row0 + i) * width + col;
    if (bf16)
      for (int d = 0; d < D; ++d) static_cast<std::uint16_t *>(base)[at + d] = float_to_bf16(x[i * D + d] * scale);
    else
      for (int d = 0; d < D; ++d) static_cast<float *>(base)[at + d] = x[i * D + d] * scale;
  }
}

// c [m, n] *= alpha (compiled for AVX-512 and AVX2 too: the same products)
__attribute__((target_clones("avx512f", "avx2", "default"))) void scale_block(float *c, int ldc, int m, int n,
                                                                              float alpha) {
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) c[i * ldc + j] *= alpha;
}
// c [m, n] = alpha a b^T, a [m, k] and b [n, k] as rows: on the fp32 tile kernel when b holds its
// transpose, on the dot kernel for bf16 rows, else sgemm.
void gemm_abt(int m, int n, int k, float alpha, Rows a, Rows b, float *c, int ldc) {
  note_library_call(b.t            ? Library::f32_tiles
                    : !a.p || !b.p ? Library::dot_bf16
                                   : Library::mkl_sgemm,
                    m, n, k, false, true);
  if (b.t) return gemm_f32_tiles(false, m, n, k, alpha, a.p, a.ld, b.t, b.t_ld, false, c, ldc);
  if (!a.p || !b.p) {  // bf16 blocks, not widened
    if (b.dot_bt.words)
      dot_bf16_gemm_packed(false, m, n, k, a.bf16, a.bf16_ld, b.dot_bt, false, c, ldc);
    else
      dot_bf16_gemm(false, true, m, n, k, a.bf16, a.bf16_ld, b.bf16, b.bf16_ld, false, c, ldc);
    if (alpha != 1.f) scale_block(c, ldc, m, n, alpha);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, alpha, a.p, a.ld, b.p, b.ld, 0.f, c, ldc);
}
// A block of P or dS [rows, cols] (row stride chunk) as a GEMM operand. In bf16 it is rounded to
// bf16 first, as PyTorch's bf16 attention rounds P and dS before their products, on every CPU:
// into `bits` when the products run on the dot kernel (`dot`: bf16 rows are not widened), else in
// place (MKL's sgemm then multiplies the rounded values).
// (Compiled for AVX-512 and AVX2 too, picked by the running CPU: integer rounding, the same bits.)
__attribute__((target_clones("avx512bw", "avx2", "default"))) void round_block(float *x, int rows, int cols, bool dot,
                                                                               std::uint16_t *bits) {
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) {
      const std::uint16_t b = float_to_bf16(x[i * chunk + j]);
      if (dot)
        bits[i * chunk + j] = b;
      else
        x[i * chunk + j] = bf16_to_float(b);
    }
}
Rows operand(float *x, int rows, int cols, bool bf16, bool dot, std::uint16_t *bits) {
  if (!bf16) return {x, chunk};
  round_block(x, rows, cols, dot, bits);
  return dot ? Rows{x, chunk, bits, chunk} : Rows{x, chunk};
}
// dS = P (dP - delta) of a tile's rows in place of dP, delta a row (no dropout; compiled as round_block).
__attribute__((target_clones("avx512f", "avx2", "default"))) void scores_gradient(const float *prob, float *dprob,
                                                                                  const float *delta, int rows,
                                                                                  int cols) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < cols; ++j) dprob[r * chunk + j] = prob[r * chunk + j] * (dprob[r * chunk + j] - delta[r]);
}
// c [m, n] = op(a) b (+ c when add), a [m, k] (stored [k, m] when trans_a) and b [k, n] as rows:
// on the dot kernel when b is bf16 rows only (then a has its bf16 copy), else on the fp32 tile
// kernel where it runs, else sgemm.
void gemm_ab(bool trans_a, int m, int n, int k, Rows a, Rows b, bool add, float *c, int ldc) {
  note_library_call(b.dot_b.words || !b.p        ? Library::dot_bf16
                    : gemm_f32_tiles_available() ? Library::f32_tiles
                                                 : Library::mkl_sgemm,
                    m, n, k, trans_a, false);
  if (b.dot_b.words) return dot_bf16_gemm_packed(trans_a, m, n, k, a.bf16, a.bf16_ld, b.dot_b, add, c, ldc);
  if (!b.p) return dot_bf16_gemm(trans_a, false, m, n, k, a.bf16, a.bf16_ld, b.bf16, b.bf16_ld, add, c, ldc);
  if (gemm_f32_tiles_available()) return gemm_f32_tiles(trans_a, m, n, k, 1.f, a.p, a.ld, b.p, b.ld, add, c, ldc);
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, CblasNoTrans, m, n, k, 1.f, a.p, a.ld, b.p, b.ld,
              add ? 1.f : 0.f, c, ldc);
}

// Sums (maxima) of a row of `lanes`-multiple length, in `lanes` partial sums added in order.
float row_sum(const float *x, int n) {
  float part[lanes] = {};
  for (int j = 0; j < n; j += lanes)
    for (int u = 0; u < lanes; ++u) part[u] += x[j + u];
  float s = 0;
  for (float p : part) s += p;
  return s;
}
float row_max(const float *x, int n) {
  float part[lanes];
  std::fill(part, part + lanes, minus_inf);
  for (int j = 0; j < n; j += lanes)
    for (int u = 0; u < lanes; ++u) part[u] = std::max(part[u], x[j + u]);
  return *std::max_element(part, part + lanes);
}

std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}
constexpr std::uint64_t golden = 0x9e3779b97f4a7c15ULL;

// The dropout multipliers of a call's probabilities (AttentionCall: the counter hash).
struct Mask {
  bool on;
  std::uint64_t key, threshold;
  float scale;
  std::uint64_t H, T;
  std::int64_t first_row;
  explicit Mask(const AttentionCall &a)
      : on(a.dropout),
        key(mix64(mix64(mix64(a.seed + golden) + (std::uint64_t(std::int64_t(a.step)) + 1) * golden) +
                  (std::uint64_t(std::int64_t(a.block)) + 1) * golden)),
        threshold(a.threshold),
        scale(a.scale),
        H(std::uint64_t(a.H)),
        T(std::uint64_t(a.T)),
        first_row(a.first_row) {}
  // P(t, s) of head h, t the position of query row `row` (n T + t)
  float factor(Index row, int h, Index s) const {
    if (threshold == 0) return scale;
    const std::uint64_t b = std::uint64_t(std::int64_t(std::int32_t(row + first_row)));
    const std::uint64_t element = b / T * (H * T * T) + std::uint64_t(h) * (T * T) + b % T * T + std::uint64_t(s);
    return (mix64(key + (element + 1) * golden) >> 32) >= threshold ? scale : 0.f;
  }
};

// The per-call constants every task reads.
struct Problem {
  AttentionCall a;
  int width, C, G;  // qkv row width, query width H D, query heads a key / value head
  float scale;      // 1 / sqrt(D)
  bool dot;         // bf16 products on the dot kernel (bf16 rows are never widened)
  Mask mask;
  const float *lse = nullptr, *delta = nullptr;
  const void *dout = nullptr;
  float *per_head = nullptr;  // the gradient's per-head sums (attention_grad_heads)
  void *result = nullptr;     // lse, out or dqkv
  explicit Problem(const AttentionCall &call)
      : a(call),
        width((call.H + 2 * call.KV) * call.D),
        C(call.H * call.D),
        G(call.H / call.KV),
        scale(float(1 / std::sqrt(double(call.D)))),
        dot(call.bf16 && dot_bf16_available()),
        mask(call) {}
  int k_col(int kv) const { return C + kv * a.D; }
  int v_col(int kv) const { return C + (a.KV + kv) * a.D; }
  int groups() const;  // groups of query blocks (forward tasks)
  int sequences() const { return a.rows / a.T; }
};

// Row i of x [m, chunk] becomes exp(x - row_shift[i]) (query rows) or exp(x - column_shift[j])
// (key rows) in columns [first(i), last(i)), exact zeros elsewhere (the mask). The exp is
// runtime/exp_float.h's, in 16 lanes on AVX-512, 8 on AVX2 and one elsewhere: the same bits.
template <class Span, class First, class Last>
[[gnu::always_inline]] inline void masked_exp_rows(Span exp_span, float *x, int m, First first, Last last,
                                                   const float *row_shift, const float *column_shift) {
  for (int i = 0; i < m; ++i) {
    const int lo = std::max(first(i), 0), hi = std::max(std::min(last(i), chunk), lo);
    float *row = x + i * chunk;
    std::fill(row, row + lo, 0.f);
    exp_span(row, lo, hi, column_shift ? 0.f : row_shift[i], column_shift);
    std::fill(row + hi, row + chunk, 0.f);
  }
}
// row[j] = exp(row[j] - (column_shift ? column_shift[j] : shift)) for j in [lo, hi)
void exp_span_scalar(float *row, int lo, int hi, float shift, const float *column_shift) {
  for (int j = lo; j < hi; ++j) row[j] = exp_float::exp_of(row[j] - (column_shift ? column_shift[j] : shift));
}
__attribute__((target("avx512f"))) void exp_span_avx512(float *row, int lo, int hi, float shift,
                                                        const float *column_shift) {
  for (int j = lo; j < hi; j += 16) {
    const __mmask16 lanes = __mmask16(hi - j >= 16 ? 0xffff : (1u << (hi - j)) - 1);
    const __m512 s = column_shift ? _mm512_maskz_loadu_ps(lanes, column_shift + j) : _mm512_set1_ps(shift);
    _mm512_mask_storeu_ps(row + j, lanes, exp_float::exp_of(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, row + j), s)));
  }
}
__attribute__((target("avx2,fma"))) void exp_span_avx2(float *row, int lo, int hi, float shift,
                                                       const float *column_shift) {
  int j = lo;
  for (; j + 8 <= hi; j += 8) {
    const __m256 s = column_shift ? _mm256_loadu_ps(column_shift + j) : _mm256_set1_ps(shift);
    _mm256_storeu_ps(row + j, exp_float::exp_of(_mm256_sub_ps(_mm256_loadu_ps(row + j), s)));
  }
  exp_span_scalar(row, j, hi, shift, column_shift);
}
template <class First, class Last>
void masked_exp(float *x, int m, First first, Last last, const float *row_shift, const float *column_shift) {
  static const bool avx512 = cpu_avx512(), avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512)
    masked_exp_rows(exp_span_avx512, x, m, first, last, row_shift, column_shift);
  else if (avx2)
    masked_exp_rows(exp_span_avx2, x, m, first, last, row_shift, column_shift);
  else
    masked_exp_rows(exp_span_scalar, x, m, first, last, row_shift, column_shift);
}

// Task order: the groups with the most work first (the causal triangle's long rows), so that the
// last tasks to start are short.
struct Task {
  int n, head, group;
};
Task query_task(const Problem &p, int i, int heads) {
  const int per_group = p.sequences() * heads, rest = i % per_group;
  return {rest / heads, rest % heads, p.groups() - 1 - i / per_group};
}

// ---- forward ----
// A task holds a group of query blocks, which share each chunk's keys (and values): each key
// chunk is read once a group, not once a block. Every tile (block by chunk) is the same GEMM and
// the same sums as a task of one block would run, so the bits do not depend on the grouping.
constexpr int forward_blocks = 8;
constexpr int group_rows = forward_blocks * block_rows;
int Problem::groups() const { return (a.T + group_rows - 1) / group_rows; }

// A block of one head's columns ([count, D] from row `row` of a tensor `width` wide) as its products
// take it: as b^T (as_bt) transposed for the fp32 tiles or packed for the dot kernel, as b (as_b)
// packed for the dot kernel; in `space` (count x max_head_dim floats), once for all the products
// of a task that take it.
Rows prepared(const Problem &p, const void *base, int width, Index row, int count, int col, float *space, bool as_bt,
              bool as_b) {
  const AttentionCall &a = p.a;
  Rows r = head_rows(base, a.bf16, width, row, count, col, a.D, space);
  if (as_bt) r = with_transpose(r, a.bf16, count, a.D, space);
  return with_packed(r, count, a.D, space, as_bt, as_b);
}

int lse_task(void *, int i, std::uint8_t *closure) {
  const Problem &p = *reinterpret_cast<const Problem *>(closure);
  const AttentionCall &a = p.a;
  const Task task = query_task(p, i, a.H);
  const int g0 = task.group * group_rows, gq = std::min(group_rows, a.T - g0), h = task.head, kv = h / p.G;
  const Index row0 = Index(task.n) * a.T;
  alignas(64) float q_copy[group_rows * max_head_dim], k_copy[chunk * max_head_dim], s[block_rows * chunk];
  float m[group_rows], l[group_rows];
  std::fill(m, m + gq, minus_inf);
  std::fill(l, l + gq, 0.f);
  const Rows q = head_rows(a.qkv, a.bf16, p.width, row0 + g0, gq, h * a.D, a.D, q_copy);
  for (int c0 = 0; c0 < g0 + gq; c0 += chunk) {
    const int kc_all = std::min(chunk, g0 + gq - c0);
    const Rows k = prepared(p, a.qkv, p.width, row0 + c0, kc_all, p.k_col(kv), k_copy, true, false);
    for (int t0 = std::max(g0, c0); t0 < g0 + gq; t0 += block_rows) {
      const int bq = std::min(block_rows, a.T - t0), kc = std::min(chunk, t0 + bq - c0), at = t0 - g0;
      gemm_abt(bq, kc, a.D, p.scale, at_row(q, at), k, s, chunk);
      float shift[block_rows];
      for (int r = 0; r < bq; ++r) {
        const int valid = std::clamp(t0 + r - c0 + 1, 0, kc);
        float *row = s + r * chunk;
        std::fill(row + valid, row + chunk, minus_inf);
        shift[r] = valid ? std::max(m[at + r], row_max(row, chunk)) : m[at + r];
      }
      masked_exp(
          s, bq, [](int) { return 0; }, [&](int r) { return std::clamp(t0 + r - c0 + 1, 0, kc); }, shift, nullptr);
      for (int r = 0; r < bq; ++r) {
        if (t0 + r < c0) continue;
        l[at + r] = l[at + r] * std::exp(m[at + r] - shift[r]) + row_sum(s + r * chunk, chunk);
        m[at + r] = shift[r];
      }
    }
  }
  float *lse = static_cast<float *>(p.result);
  for (int r = 0; r < gq; ++r) lse[(row0 + g0 + r) * a.H + h] = m[r] + std::log(l[r]);
  return 0;
}

// P of rows [t0, t0 + bq) by keys [c0, c0 + kc) of head h into s (ld chunk), with its dropout
// multipliers applied when `kept`.
void query_probabilities(const Problem &p, Index row0, int t0, int bq, int c0, int kc, int h, Rows q, Rows k, bool kept,
                         float *s) {
  gemm_abt(bq, kc, p.a.D, p.scale, q, k, s, chunk);
  float lse[block_rows];
  for (int r = 0; r < bq; ++r) lse[r] = p.lse[(row0 + t0 + r) * p.a.H + h];
  masked_exp(s, bq, [](int) { return 0; }, [&](int r) { return std::clamp(t0 + r - c0 + 1, 0, kc); }, lse, nullptr);
  if (kept && p.mask.on)
    for (int r = 0; r < bq; ++r)
      for (int j = 0; j < kc && c0 + j <= t0 + r; ++j) s[r * chunk + j] *= p.mask.factor(row0 + t0 + r, h, c0 + j);
}

int out_task(void *, int i, std::uint8_t *closure) {
  const Problem &p = *reinterpret_cast<const Problem *>(closure);
  const AttentionCall &a = p.a;
  const Task task = query_task(p, i, a.H);
  const int g0 = task.group * group_rows, gq = std::min(group_rows, a.T - g0), h = task.head, kv = h / p.G;
  const Index row0 = Index(task.n) * a.T;
  alignas(64) float q_copy[group_rows * max_head_dim], k_copy[chunk * max_head_dim], v_copy[chunk * max_head_dim],
      s[block_rows * chunk], o[group_rows * max_head_dim];
  alignas(64) std::uint16_t s16[block_rows * chunk];
  const Rows q = head_rows(a.qkv, a.bf16, p.width, row0 + g0, gq, h * a.D, a.D, q_copy);
  for (int c0 = 0; c0 < g0 + gq; c0 += chunk) {
    const int kc_all = std::min(chunk, g0 + gq - c0);
    const Rows k = prepared(p, a.qkv, p.width, row0 + c0, kc_all, p.k_col(kv), k_copy, true, false);
    const Rows v = prepared(p, a.qkv, p.width, row0 + c0, kc_all, p.v_col(kv), v_copy, false, true);
    for (int t0 = std::max(g0, c0); t0 < g0 + gq; t0 += block_rows) {
      const int bq = std::min(block_rows, a.T - t0), kc = std::min(chunk, t0 + bq - c0), at = t0 - g0;
      query_probabilities(p, row0, t0, bq, c0, kc, h, at_row(q, at), k, true, s);
      gemm_ab(false, bq, a.D, kc, operand(s, bq, kc, a.bf16, p.dot, s16), v, c0 > 0, o + at * a.D, a.D);
    }
  }
  store_rows(o, 1.f, p.result, a.bf16, p.C, row0 + g0, gq, h * a.D, a.D);
  return 0;
}

// ---- backward ----
constexpr int grad_chunks = 4;  // key chunks a backward group holds (its dk and dv on the stack)
// The gradients of one query head h (a task per sequence and query head), one pass over the
// forward's tiles (blocks of query rows by chunks of keys), groups of key chunks outer (each query
// block's q, dout and dq then read once a group, not once a chunk): P rebuilt from lse
// exactly as the forward's output pass built it (the same products, so each row sums as lse says),
// dP = dout v^T, dS = P (dP keep - delta); dv += drop(P)^T dout and dk += dS^T q over the chunk's
// query blocks (on the stack, written to the head's columns of `per_head` when the chunk ends), and
// dq += dS k in the head's dq columns of `per_head`, each query row's sum over the chunks in order.
// dq and dk without 1 / sqrt(D).
int grad_task(void *, int i, std::uint8_t *closure) {
  const Problem &p = *reinterpret_cast<const Problem *>(closure);
  const AttentionCall &a = p.a;
  const int n = i / a.H, h = i % a.H, kv = h / p.G, D = a.D, ld = 3 * p.C;
  const Index row0 = Index(n) * a.T;
  float *const dq_of = p.per_head + row0 * ld + h * D, *const dk_of = dq_of + p.C, *const dv_of = dk_of + p.C;
  constexpr int keys = grad_chunks * chunk;  // a group of chunks shares each query block's loads
  alignas(64) float k_copy[keys * max_head_dim], v_copy[keys * max_head_dim], q_copy[block_rows * max_head_dim],
      do_copy[block_rows * max_head_dim], s[block_rows * chunk], dp[block_rows * chunk], dk[keys * max_head_dim],
      dv[keys * max_head_dim];
  alignas(64) std::uint16_t s16[block_rows * chunk], dp16[block_rows * chunk];
  for (int g0 = 0; g0 < a.T; g0 += keys) {
    const int kg = std::min(keys, a.T - g0);
    const Rows k = prepared(p, a.qkv, p.width, row0 + g0, kg, p.k_col(kv), k_copy, true, true);
    const Rows v = prepared(p, a.qkv, p.width, row0 + g0, kg, p.v_col(kv), v_copy, true, false);
    std::fill(dk, dk + kg * D, 0.f);  // the diagonal tiles reach only some of the group's keys
    std::fill(dv, dv + kg * D, 0.f);
    for (int t0 = g0; t0 < a.T; t0 += block_rows) {
      const int bq = std::min(block_rows, a.T - t0);
      const Rows q = prepared(p, a.qkv, p.width, row0 + t0, bq, h * D, q_copy, false, true);
      const Rows dout = prepared(p, p.dout, p.C, row0 + t0, bq, h * D, do_copy, false, true);
      for (int c0 = g0; c0 < std::min(g0 + kg, t0 + bq); c0 += chunk) {
        const int kc = std::min(chunk, t0 + bq - c0), at = c0 - g0;  // the forward's tile
        const Rows kt = at_row(k, at), vt = at_row(v, at);
        query_probabilities(p, row0, t0, bq, c0, kc, h, q, kt, false, s);
        gemm_abt(bq, kc, D, 1.f, dout, vt, dp, chunk);
        float delta[block_rows];  // dS = P (dP keep - delta), zero where P is
        for (int r = 0; r < bq; ++r) delta[r] = p.delta[(row0 + t0 + r) * a.H + h];
        if (!p.mask.on)
          scores_gradient(s, dp, delta, bq, kc);
        else
          for (int r = 0; r < bq; ++r) {
            float *prob = s + r * chunk, *dprob = dp + r * chunk;
            for (int j = 0; j < kc; ++j) {
              const float f = p.mask.factor(row0 + t0 + r, h, c0 + j);
              dprob[j] = prob[j] * (dprob[j] * f - delta[r]);
              prob[j] *= f;  // drop(P)
            }
          }
        gemm_ab(true, kc, D, bq, operand(s, bq, kc, a.bf16, p.dot, s16), dout, true, dv + at * D, D);
        const Rows ds = operand(dp, bq, kc, a.bf16, p.dot, dp16);
        gemm_ab(true, kc, D, bq, ds, q, true, dk + at * D, D);
        // dq of the block's rows += dS k: the first chunk writes every query row first
        gemm_ab(false, bq, D, kc, ds, kt, c0 > 0, dq_of + Index(t0) * ld, ld);
      }
    }
    for (int r = 0; r < kg; ++r) {
      std::memcpy(dk_of + Index(g0 + r) * ld, dk + r * D, D * sizeof(float));
      std::memcpy(dv_of + Index(g0 + r) * ld, dv + r * D, D * sizeof(float));
    }
  }
  return 0;
}

// dqkv of a block of rows from `per_head`: dq / sqrt(D); dk / sqrt(D) and dv, each the sum of its
// group's query heads in head order.
constexpr int sum_rows = 16;
// sum[d] = the sum of `heads` rows of D (x, x + D, ...) in order, from 0 (vectorized over d).
__attribute__((target_clones("avx512f", "avx2", "default"))) void group_sum(const float *x, int heads, int D,
                                                                            float *sum) {
  for (int d = 0; d < D; ++d) sum[d] = 0.f;
  for (int g = 0; g < heads; ++g)
    for (int d = 0; d < D; ++d) sum[d] += x[g * D + d];
}
int sum_task(void *, int i, std::uint8_t *closure) {
  const Problem &p = *reinterpret_cast<const Problem *>(closure);
  const AttentionCall &a = p.a;
  const int D = a.D, ld = 3 * p.C;
  const bool stored = a.bf16 && !a.fp32_dqkv;
  for (Index b = Index(i) * sum_rows; b < std::min(Index(a.rows), Index(i + 1) * sum_rows); ++b) {
    const float *src = p.per_head + b * ld;
    store_rows(src, p.scale, p.result, stored, p.width, b, 1, 0, p.C);
    for (int kv = 0; kv < a.KV; ++kv) {
      alignas(64) float dk[max_head_dim], dv[max_head_dim];
      group_sum(src + p.C + kv * p.G * D, p.G, D, dk);
      group_sum(src + 2 * p.C + kv * p.G * D, p.G, D, dv);
      store_rows(dk, p.scale, p.result, stored, p.width, b, 1, p.k_col(kv), D);
      store_rows(dv, 1.f, p.result, stored, p.width, b, 1, p.v_col(kv), D);
    }
  }
  return 0;
}

void check(const AttentionCall &a) {
  if (a.T < 1 || a.rows < 0 || a.rows % a.T || a.H < 1 || a.KV < 1 || a.H % a.KV || a.D < 1 || a.D > max_head_dim)
    throw std::invalid_argument("attention: rows " + std::to_string(a.rows) + ", T " + std::to_string(a.T) + ", H " +
                                std::to_string(a.H) + ", KV " + std::to_string(a.KV) + ", D " + std::to_string(a.D) +
                                " (rows whole sequences, KV dividing H, D at most " + std::to_string(max_head_dim) +
                                ")");
}
void run_tasks(int (*task)(void *, int, std::uint8_t *), int count, Problem &p) {
  if (count > 0) halide_do_par_for(nullptr, task, 0, count, reinterpret_cast<std::uint8_t *>(&p));
}

}  // namespace

void attention_lse(const AttentionCall &a, float *lse) {
  check(a);
  Problem p(a);
  p.result = lse;
  run_tasks(lse_task, p.sequences() * a.H * p.groups(), p);
}

void attention_out(const AttentionCall &a, const float *lse, void *out) {
  check(a);
  Problem p(a);
  p.lse = lse;
  p.result = out;
  run_tasks(out_task, p.sequences() * a.H * p.groups(), p);
}

void attention_grad_heads(const AttentionCall &a, const float *lse, const void *dout, const float *delta,
                          float *per_head) {
  check(a);
  Problem p(a);
  p.lse = lse;
  p.dout = dout;
  p.delta = delta;
  p.per_head = per_head;
  run_tasks(grad_task, p.sequences() * a.H, p);
}

void attention_grad_sum(const AttentionCall &a, const float *per_head, void *dqkv) {
  check(a);
  Problem p(a);
  p.per_head = const_cast<float *>(per_head);
  p.result = dqkv;
  run_tasks(sum_task, (a.rows + sum_rows - 1) / sum_rows, p);
}

void attention_grad(const AttentionCall &a, const float *lse, const void *dout, const float *delta, float *per_head,
                    void *dqkv) {
  attention_grad_heads(a, lse, dout, delta, per_head);
  attention_grad_sum(a, per_head, dqkv);
}

}  // namespace remat

// ---- extern stages (generators/kinds/attention/rules.h) ----
// Every buffer is a whole dense tensor of the output's rows (the stages are computed at the
// root); a bounds query is answered with exactly that. Arguments: the shape (T, H, KV, D), then
// for out and grad the dropout counters (AttentionCall's fields; dropout 0: none).
namespace {
struct Extern {
  remat::AttentionCall call;
  const halide_buffer_t *out;  // the stage's output; its rows are the call's
  // Answers a bounds query of input b ([rows, cols]); true when there was one.
  bool bounds(halide_buffer_t *b, int cols) const {
    if (!b->is_bounds_query()) return false;
    b->dim[0] = {0, cols, 0, 0};
    b->dim[1] = {out->dim[1].min, out->dim[1].extent, 0, 0};
    return true;
  }
  // a stored tensor (fp32 or bf16 as qkv) or an fp32 one
  const void *host(const halide_buffer_t *b, int cols, bool stored, const char *name) const {
    const int bits = stored && call.bf16 ? 16 : 32;
    if (b->dimensions != 2 || b->dim[0].min != 0 || b->dim[0].extent != cols || b->dim[0].stride != 1 ||
        b->dim[1].min != out->dim[1].min || b->dim[1].extent != out->dim[1].extent || b->dim[1].stride != cols ||
        b->type.bits != bits || b->device_dirty() || !b->host)
      throw std::runtime_error(std::string(name) + " is not a dense host tensor of the attention's shape and type");
    return b->host;
  }
};
Extern make(halide_buffer_t *qkv, int T, int H, int KV, int D, const halide_buffer_t *out) {
  Extern e{{}, out};
  e.call.rows = out->dim[1].extent;
  e.call.T = T, e.call.H = H, e.call.KV = KV, e.call.D = D;
  e.call.bf16 = qkv->type.bits == 16;
  return e;
}
void set_dropout(Extern &e, int dropout, std::uint64_t seed, int step, int block, std::uint64_t threshold, float scale,
                 int first_row) {
  e.call.dropout = dropout != 0;
  e.call.seed = seed, e.call.step = step, e.call.block = block, e.call.threshold = threshold, e.call.scale = scale;
  e.call.first_row = first_row;
}
int failed(const char *stage, const std::exception &e) {
  std::snprintf(remat_halide_error, sizeof remat_halide_error, "%s: %s", stage, e.what());
  return -1;
}
}  // namespace

extern "C" int remat_attention_lse(halide_buffer_t *qkv, int32_t T, int32_t H, int32_t KV, int32_t D,
                                   halide_buffer_t *lse) {
  try {
    Extern e = make(qkv, T, H, KV, D, lse);
    const int width = (H + 2 * KV) * D;
    if (e.bounds(qkv, width) || lse->is_bounds_query()) return 0;
    e.call.qkv = e.host(qkv, width, true, "qkv");
    remat::attention_lse(e.call, static_cast<float *>(const_cast<void *>(e.host(lse, H, false, "lse"))));
  } catch (const std::exception &x) { return failed("attention statistics", x); }
  return 0;
}

extern "C" int remat_attention_out(halide_buffer_t *qkv, halide_buffer_t *lse, int32_t T, int32_t H, int32_t KV,
                                   int32_t D, int32_t dropout, uint64_t seed, int32_t step, int32_t block,
                                   uint64_t threshold, float scale, int32_t first_row, halide_buffer_t *out) {
  try {
    Extern e = make(qkv, T, H, KV, D, out);
    const int width = (H + 2 * KV) * D;
    const int queries = e.bounds(qkv, width) + e.bounds(lse, H);
    if (queries || out->is_bounds_query()) return 0;
    set_dropout(e, dropout, seed, step, block, threshold, scale, first_row);
    e.call.qkv = e.host(qkv, width, true, "qkv");
    remat::attention_out(e.call, static_cast<const float *>(e.host(lse, H, false, "lse")),
                         const_cast<void *>(e.host(out, H * D, true, "out")));
  } catch (const std::exception &x) { return failed("attention", x); }
  return 0;
}

extern "C" int remat_attention_grad(halide_buffer_t *qkv, halide_buffer_t *lse, halide_buffer_t *dout,
                                    halide_buffer_t *delta, int32_t T, int32_t H, int32_t KV, int32_t D,
                                    int32_t dropout, uint64_t seed, int32_t step, int32_t block, uint64_t threshold,
                                    float scale, int32_t first_row, halide_buffer_t *per_head) {
  try {
    Extern e = make(qkv, T, H, KV, D, per_head);
    const int width = (H + 2 * KV) * D;
    const int queries = e.bounds(qkv, width) + e.bounds(lse, H) + e.bounds(dout, H * D) + e.bounds(delta, H);
    if (queries || per_head->is_bounds_query()) return 0;
    set_dropout(e, dropout, seed, step, block, threshold, scale, first_row);
    e.call.qkv = e.host(qkv, width, true, "qkv");
    remat::attention_grad_heads(
        e.call, static_cast<const float *>(e.host(lse, H, false, "lse")), e.host(dout, H * D, true, "dout"),
        static_cast<const float *>(e.host(delta, H, false, "delta")),
        static_cast<float *>(const_cast<void *>(e.host(per_head, 3 * H * D, false, "per_head"))));
  } catch (const std::exception &x) { return failed("attention gradient", x); }
  return 0;
}

// dqkv is stored as its own type says: bf16, or fp32 (also under bf16, when one term of a sum).
extern "C" int remat_attention_grad_sum(halide_buffer_t *per_head, int32_t T, int32_t H, int32_t KV, int32_t D,
                                        halide_buffer_t *dqkv) {
  try {
    Extern e = make(dqkv, T, H, KV, D, dqkv);
    if (e.bounds(per_head, 3 * H * D) || dqkv->is_bounds_query()) return 0;
    remat::attention_grad_sum(e.call, static_cast<const float *>(e.host(per_head, 3 * H * D, false, "per_head")),
                              const_cast<void *>(e.host(dqkv, (H + 2 * KV) * D, true, "dqkv")));
  } catch (const std::exception &x) { return failed("attention gradient sum", x); }
  return 0;
}
