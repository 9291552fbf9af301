// Causal self-attention on the host (attention.h): the extern stages remat_attention_lse,
// remat_attention_out and remat_attention_grad that the CPU kernels call, and the blocked
// algorithm behind them.
//
// Forward, a task per (sequence, head, block of query rows): the scores of a chunk of key
// positions are one GEMM (q k^T), exp(score - lse) one call of MKL's vector exp, and the chunk's
// share of the output one more GEMM (P v). The statistics (lse) are their own pass, online over
// the chunks, so that the output pass reads them as a recompute reads the saved ones.
// Backward as FlashAttention-2 without atomics: dq by (sequence, head, block of query rows), dk
// and dv by (sequence, key / value head, block of key rows), each rebuilding P from lse and
// dP = dout v^T per chunk; dS = P (dP - delta). bf16: the products of two bf16 blocks (scores and
// dP) run on AVX512_BF16's dot product where the CPU has it (runtime/dot_bf16.cpp), the products
// with P or dS (fp32) in MKL's sgemm on widened copies.
#include "attention.h"

#include "bf16.h"
#include "dot_bf16.h"

#include <HalideRuntime.h>
#include <mkl.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>

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
// MKL's vector exp: at most 4 ulp, errors ignored (exp(-inf) = 0 is how the mask reaches P)
constexpr MKL_INT64 exp_mode = VML_LA | VML_ERRMODE_IGNORE | VML_FTZDAZ_CURRENT;

using Index = std::ptrdiff_t;

// A [count, D] block of one head's columns: as fp32 rows (row stride ld), the tensor itself (fp32)
// or a widened copy in `copy` (bf16); and bf16's own rows (row stride bf16_ld). A bf16 block is
// widened only when an fp32 product reads it: its products with another bf16 block run on
// AVX512_BF16's dot product where the CPU has it (gemm_abt).
struct Rows {
  const float *p;
  int ld;
  const std::uint16_t *bf16 = nullptr;
  int bf16_ld = 0;
};
Rows head_rows(const void *base, bool bf16, int width, Index row0, int count, int col, int D, float *copy,
               bool widened = true) {
  if (!bf16) return {static_cast<const float *>(base) + row0 * width + col, width};
  const auto *src = static_cast<const std::uint16_t *>(base) + row0 * width + col;
  if (!widened && dot_bf16_available()) return {nullptr, 0, src, width};
  for (int i = 0; i < count; ++i)
    for (int d = 0; d < D; ++d) copy[i * D + d] = bf16_to_float(src[Index(i) * width + d]);
  return {copy, D, src, width};
}
// Writes a [count, D] fp32 block times `scale` into the head's columns of a stored tensor.
void store_rows(const float *x, float scale, void *base, bool bf16, int width, Index row0, int count, int col, int D) {
  for (int i = 0; i < count; ++i)
    for (int d = 0; d < D; ++d) {
      const float y = x[i * D + d] * scale;
      const Index at = (row0 + i) * width + col + d;
      if (bf16)
        static_cast<std::uint16_t *>(base)[at] = float_to_bf16(y);
      else
        static_cast<float *>(base)[at] = y;
    }
}

// c [m, n] = alpha a b^T + beta c, a [m, k] and b [n, k] as rows
void gemm_abt(int m, int n, int k, float alpha, Rows a, Rows b, float beta, float *c, int ldc) {
  if (!a.p || !b.p) {  // bf16 blocks, not widened: beta is 0 in every such call
    dot_bf16_gemm(false, true, m, n, k, a.bf16, a.bf16_ld, b.bf16, b.bf16_ld, false, c, ldc);
    if (alpha != 1.f)
      for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) c[i * ldc + j] *= alpha;
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, alpha, a.p, a.ld, b.p, b.ld, beta, c, ldc);
}
// c [m, n] = a b + beta c, a [m, k] (row stride lda) and b [k, n] as rows
void gemm_ab(int m, int n, int k, const float *a, int lda, Rows b, float beta, float *c, int ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.f, a, lda, b.p, b.ld, beta, c, ldc);
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
  Mask mask;
  const float *lse = nullptr, *delta = nullptr;
  const void *dout = nullptr;
  void *result = nullptr;  // lse, out or dqkv
  explicit Problem(const AttentionCall &call)
      : a(call),
        width((call.H + 2 * call.KV) * call.D),
        C(call.H * call.D),
        G(call.H / call.KV),
        scale(float(1 / std::sqrt(double(call.D)))),
        mask(call) {}
  int k_col(int kv) const { return C + kv * a.D; }
  int v_col(int kv) const { return C + (a.KV + kv) * a.D; }
  int blocks() const { return (a.T + block_rows - 1) / block_rows; }
  int sequences() const { return a.rows / a.T; }
};

// Row i of x [m, chunk] keeps columns [first(i), last(i)) as x - row_shift[i] (query rows) or
// x - column_shift[j] (key rows), the rest -inf; then x = exp(x) over the whole block (masked
// entries exact zeros).
template <class First, class Last>
void masked_exp(float *x, int m, First first, Last last, const float *row_shift, const float *column_shift) {
  for (int i = 0; i < m; ++i) {
    const int lo = first(i), hi = last(i);
    float *row = x + i * chunk;
    if (column_shift)
      for (int j = 0; j < chunk; ++j) row[j] = j >= lo && j < hi ? row[j] - column_shift[j] : minus_inf;
    else
      for (int j = 0; j < chunk; ++j) row[j] = j >= lo && j < hi ? row[j] - row_shift[i] : minus_inf;
  }
  vmsExp(m * chunk, x, x, exp_mode);
}

// Task order: the blocks with the most work first (the causal triangle's long rows), so that the
// last tasks to start are short.
struct Task {
  int n, head, block;
};
Task query_task(const Problem &p, int i, int heads) {
  const int per_block = p.sequences() * heads, rest = i % per_block;
  return {rest / heads, rest % heads, p.blocks() - 1 - i / per_block};
}
Task key_task(const Problem &p, int i, int heads) {
  const int per_block = p.sequences() * heads, rest = i % per_block;
  return {rest / heads, rest % heads, i / per_block};
}

// ---- forward ----
int lse_task(void *, int i, std::uint8_t *closure) {
  const Problem &p = *reinterpret_cast<const Problem *>(closure);
  const AttentionCall &a = p.a;
  const Task task = query_task(p, i, a.H);
  const int t0 = task.block * block_rows, bq = std::min(block_rows, a.T - t0), h = task.head, kv = h / p.G;
  const Index row0 = Index(task.n) * a.T;
  alignas(64) float q_copy[block_rows * max_head_dim], k_copy[chunk * max_head_dim], s[block_rows * chunk];
  float m[block_rows], l[block_rows];
  std::fill(m, m + bq, minus_inf);
  std::fill(l, l + bq, 0.f);
  const Rows q = head_rows(a.qkv, a.bf16, p.width, row0 + t0, bq, h * a.D, a.D, q_copy, false);
  for (int c0 = 0; c0 < t0 + bq; c0 += chunk) {
    const int kc = std::min(chunk, t0 + bq - c0);
    const Rows k = head_rows(a.qkv, a.bf16, p.width, row0 + c0, kc, p.k_col(kv), a.D, k_copy, false);
    gemm_abt(bq, kc, a.D, p.scale, q, k, 0.f, s, chunk);
    float shift[block_rows];
    for (int r = 0; r < bq; ++r) {
      const int valid = std::clamp(t0 + r - c0 + 1, 0, kc);
      float *row = s + r * chunk;
      std::fill(row + valid, row + chunk, minus_inf);
      shift[r] = valid ? std::max(m[r], row_max(row, chunk)) : m[r];
    }
    masked_exp(s, bq, [](int) { return 0; }, [&](int r) { return std::clamp(t0 + r - c0 + 1, 0, kc); }, shift, nullptr);
    for (int r = 0; r < bq; ++r) {
      if (t0 + r < c0) continue;
      l[r] = l[r] * std::exp(m[r] - shift[r]) + row_sum(s + r * chunk, chunk);
      m[r] = shift[r];
    }
  }
  float *lse = static_cast<float *>(p.result);
  for (int r = 0; r < bq; ++r) lse[(row0 + t0 + r) * a.H + h] = m[r] + std::log(l[r]);
  return 0;
}

// P of rows [t0, t0 + bq) by keys [c0, c0 + kc) of head h into s (ld chunk), with its dropout
// multipliers applied when `kept`.
void query_probabilities(const Problem &p, Index row0, int t0, int bq, int c0, int kc, int h, Rows q, Rows k, bool kept,
                         float *s) {
  gemm_abt(bq, kc, p.a.D, p.scale, q, k, 0.f, s, chunk);
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
  const int t0 = task.block * block_rows, bq = std::min(block_rows, a.T - t0), h = task.head, kv = h / p.G;
  const Index row0 = Index(task.n) * a.T;
  alignas(64) float q_copy[block_rows * max_head_dim], k_copy[chunk * max_head_dim], v_copy[chunk * max_head_dim],
      s[block_rows * chunk], o[block_rows * max_head_dim];
  const Rows q = head_rows(a.qkv, a.bf16, p.width, row0 + t0, bq, h * a.D, a.D, q_copy, false);
  for (int c0 = 0; c0 < t0 + bq; c0 += chunk) {
    const int kc = std::min(chunk, t0 + bq - c0);
    const Rows k = head_rows(a.qkv, a.bf16, p.width, row0 + c0, kc, p.k_col(kv), a.D, k_copy, false);
    query_probabilities(p, row0, t0, bq, c0, kc, h, q, k, true, s);
    const Rows v = head_rows(a.qkv, a.bf16, p.width, row0 + c0, kc, p.v_col(kv), a.D, v_copy);
    gemm_ab(bq, a.D, kc, s, chunk, v, c0 ? 1.f : 0.f, o, a.D);
  }
  store_rows(o, 1.f, p.result, a.bf16, p.C, row0 + t0, bq, h * a.D, a.D);
  return 0;
}

// ---- backward ----
// dq of a block of query rows of head h: sum over key chunks of dS k / sqrt(D).
int dq_task(void *, int i, std::uint8_t *closure) {
  const Problem &p = *reinterpret_cast<const Problem *>(closure);
  const AttentionCall &a = p.a;
  const Task task = query_task(p, i, a.H);
  const int t0 = task.block * block_rows, bq = std::min(block_rows, a.T - t0), h = task.head, kv = h / p.G;
  const Index row0 = Index(task.n) * a.T;
  alignas(64) float q_copy[block_rows * max_head_dim], do_copy[block_rows * max_head_dim], k_copy[chunk * max_head_dim],
      v_copy[chunk * max_head_dim], s[block_rows * chunk], dp[block_rows * chunk], dq[block_rows * max_head_dim];
  const Rows q = head_rows(a.qkv, a.bf16, p.width, row0 + t0, bq, h * a.D, a.D, q_copy, false);
  const Rows dout = head_rows(p.dout, a.bf16, p.C, row0 + t0, bq, h * a.D, a.D, do_copy, false);
  for (int c0 = 0; c0 < t0 + bq; c0 += chunk) {
    const int kc = std::min(chunk, t0 + bq - c0);
    const Rows k = head_rows(a.qkv, a.bf16, p.width, row0 + c0, kc, p.k_col(kv), a.D, k_copy);
    const Rows v = head_rows(a.qkv, a.bf16, p.width, row0 + c0, kc, p.v_col(kv), a.D, v_copy, false);
    query_probabilities(p, row0, t0, bq, c0, kc, h, q, k, false, s);
    gemm_abt(bq, kc, a.D, 1.f, dout, v, 0.f, dp, chunk);
    for (int r = 0; r < bq; ++r) {  // dS = P (dP keep - delta), zero where P is
      const Index row = row0 + t0 + r;
      const float delta = p.delta[row * a.H + h];
      float *prob = s + r * chunk, *dprob = dp + r * chunk;
      if (!p.mask.on)
        for (int j = 0; j < kc; ++j) prob[j] *= dprob[j] - delta;
      else
        for (int j = 0; j < kc; ++j) prob[j] *= dprob[j] * p.mask.factor(row, h, c0 + j) - delta;
    }
    gemm_ab(bq, a.D, kc, s, chunk, k, c0 ? 1.f : 0.f, dq, a.D);
  }
  store_rows(dq, p.scale, p.result, a.bf16 && !a.fp32_dqkv, p.width, row0 + t0, bq, h * a.D, a.D);
  return 0;
}

// dk and dv of a block of key rows of key / value head kv: sums over the query heads of its
// group (in order) and over the chunks of queries at or after the block of dS^T q / sqrt(D) and
// drop(P)^T dout.
int dkv_task(void *, int i, std::uint8_t *closure) {
  const Problem &p = *reinterpret_cast<const Problem *>(closure);
  const AttentionCall &a = p.a;
  const Task task = key_task(p, i, a.KV);
  const int s0 = task.block * block_rows, bk = std::min(block_rows, a.T - s0), kv = task.head;
  const Index row0 = Index(task.n) * a.T;
  alignas(64) float k_copy[block_rows * max_head_dim], v_copy[block_rows * max_head_dim], q_copy[chunk * max_head_dim],
      do_copy[chunk * max_head_dim], st[block_rows * chunk], dpt[block_rows * chunk], dk[block_rows * max_head_dim],
      dv[block_rows * max_head_dim];
  const Rows k = head_rows(a.qkv, a.bf16, p.width, row0 + s0, bk, p.k_col(kv), a.D, k_copy, false);
  const Rows v = head_rows(a.qkv, a.bf16, p.width, row0 + s0, bk, p.v_col(kv), a.D, v_copy, false);
  bool first = true;
  for (int h = kv * p.G; h < (kv + 1) * p.G; ++h)
    for (int q0 = s0; q0 < a.T; q0 += chunk) {
      const int qc = std::min(chunk, a.T - q0);
      const Rows q = head_rows(a.qkv, a.bf16, p.width, row0 + q0, qc, h * a.D, a.D, q_copy);
      const Rows dout = head_rows(p.dout, a.bf16, p.C, row0 + q0, qc, h * a.D, a.D, do_copy);
      gemm_abt(bk, qc, a.D, p.scale, k, q, 0.f, st, chunk);  // S^T: key rows by query columns
      float lse[chunk], delta[chunk];                        // of the chunk's queries
      for (int j = 0; j < qc; ++j) {
        lse[j] = p.lse[(row0 + q0 + j) * a.H + h];
        delta[j] = p.delta[(row0 + q0 + j) * a.H + h];
      }
      masked_exp(  // P^T: queries t >= s only
          st, bk, [&](int r) { return std::max(0, s0 + r - q0); }, [&](int) { return qc; }, nullptr, lse);
      gemm_abt(bk, qc, a.D, 1.f, v, dout, 0.f, dpt, chunk);
      for (int r = 0; r < bk; ++r) {
        const Index s = s0 + r;
        const int first_query = std::max(0, int(s - q0));
        std::fill(dpt + r * chunk, dpt + r * chunk + first_query, 0.f);  // dS^T is 0 where P^T is
        float *prob = st + r * chunk, *dprob = dpt + r * chunk;
        if (!p.mask.on)
          for (int j = first_query; j < qc; ++j) dprob[j] = prob[j] * (dprob[j] - delta[j]);  // dS^T
        else
          for (int j = first_query; j < qc; ++j) {
            const float f = p.mask.factor(row0 + q0 + j, h, s);
            dprob[j] = prob[j] * (dprob[j] * f - delta[j]);
            prob[j] *= f;  // drop(P)^T
          }
      }
      gemm_ab(bk, a.D, qc, st, chunk, dout, first ? 0.f : 1.f, dv, a.D);
      gemm_ab(bk, a.D, qc, dpt, chunk, q, first ? 0.f : 1.f, dk, a.D);
      first = false;
    }
  store_rows(dk, p.scale, p.result, a.bf16 && !a.fp32_dqkv, p.width, row0 + s0, bk, p.k_col(kv), a.D);
  store_rows(dv, 1.f, p.result, a.bf16 && !a.fp32_dqkv, p.width, row0 + s0, bk, p.v_col(kv), a.D);
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
  run_tasks(lse_task, p.sequences() * a.H * p.blocks(), p);
}

void attention_out(const AttentionCall &a, const float *lse, void *out) {
  check(a);
  Problem p(a);
  p.lse = lse;
  p.result = out;
  run_tasks(out_task, p.sequences() * a.H * p.blocks(), p);
}

void attention_grad(const AttentionCall &a, const float *lse, const void *dout, const float *delta, void *dqkv) {
  check(a);
  Problem p(a);
  p.lse = lse;
  p.dout = dout;
  p.delta = delta;
  p.result = dqkv;
  run_tasks(dq_task, p.sequences() * a.H * p.blocks(), p);
  run_tasks(dkv_task, p.sequences() * a.KV * p.blocks(), p);
}

void attention_warm_up() {
  float x[lanes] = {};
  vmsExp(lanes, x, x, exp_mode);
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
                                    float scale, int32_t first_row, halide_buffer_t *dqkv) {
  try {
    Extern e = make(qkv, T, H, KV, D, dqkv);
    const int width = (H + 2 * KV) * D;
    const int queries = e.bounds(qkv, width) + e.bounds(lse, H) + e.bounds(dout, H * D) + e.bounds(delta, H);
    if (queries || dqkv->is_bounds_query()) return 0;
    set_dropout(e, dropout, seed, step, block, threshold, scale, first_row);
    e.call.qkv = e.host(qkv, width, true, "qkv");
    // dqkv: stored like qkv when it is the tensor's gradient itself, fp32 when it is one term of a sum
    const bool stored = dqkv->type.bits == 16 || !e.call.bf16;
    e.call.fp32_dqkv = !stored;
    remat::attention_grad(e.call, static_cast<const float *>(e.host(lse, H, false, "lse")),
                          e.host(dout, H * D, true, "dout"),
                          static_cast<const float *>(e.host(delta, H, false, "delta")),
                          const_cast<void *>(e.host(dqkv, width, stored, "dqkv")));
  } catch (const std::exception &x) { return failed("attention gradient", x); }
  return 0;
}
