// The attention kind's algorithm: causal multi-head (or grouped-query) self-attention on fused
// [q | k | v] rows, forward with a per-row log-sum-exp and a FlashAttention-style backward that
// rebuilds the probabilities from it, by rows (any target) or by (sequence, head) tiles (the CPU),
// dropout on the probabilities from the counter-based RNG. Same conventions as layers.h: element
// type a parameter, hand-written vector-Jacobian rules, no schedules (schedule.h).
//
// Layout: an activation [rows, C] is a Func f(c, b), c the contiguous feature index, b the row
// n * T + t (sequences.h).
#pragma once

#include <Halide.h>

#include "kinds/dropout/algorithm.h"
#include "layers.h"
#include "sequences.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace remat::gen {

struct Attention {
  Halide::Func out;      // out(c, b), c in [0, C): sum_{s <= t} drop(P)(s) v(s) per head, stored
  Halide::Func sum;      // the sum itself, in the element type
  Halide::Func lse;      // lse(h, b): log-sum-exp of the head's scaled scores of row b ([rows, H])
  Halide::Func dot;      // dot(s, h, b) = q(b) . k(n T + s) over the head (update over d)
  Halide::Func lse_dot;  // the same, in the chain that computes lse
  Halide::Func score;    // score(s, h, b) = dot / sqrt(D)
  Halide::Func row_max;  // row_max(h, b) = max_{s <= t} score
  Halide::Func sum_exp;  // sum_exp(h, b) = sum_{s <= t} exp(score - row_max)
  Halide::Func prob;     // prob(s, h, b) = exp(score - lse), meaningful for s <= t
  Halide::Func keep;     // keep(s, h, b) = keep / (1 - p) (0 or 1/(1-p)); undefined without dropout
  Halide::Func kept;     // kept(s, h, b) = prob * keep (prob itself without dropout)
};
// Probabilities and score gradients rebuilt from qkv, lse and dout; attention_grad builds one
// such chain for the query rows (dq) and one for the key rows (dk, dv), so that a schedule can
// compute each per row where it is consumed.
struct ScoreGradChain {
  Halide::Func dot, score, prob, keep, kept;  // as in Attention (keep: the same mask)
  Halide::Func dprob_kept;                    // dout(b) . v(n T + s) over the head
  Halide::Func dprob;                         // dprob_kept * keep (dprob_kept without dropout)
  Halide::Func dscore;                        // prob * (dprob - delta)
};
struct AttentionGrad {
  Halide::Func dqkv;        // dqkv(c, b), c in [0, 3C): [dq | dk | dv]
  Halide::Func dq, dk, dv;  // each (c, b), c in [0, C)
  Halide::Func delta;       // delta(h, b) = sum_d dout * out over the head
  ScoreGradChain q;         // query side: f(s, h, b) for query row b and key position s (read by dq)
  ScoreGradChain kv;        // key side: f(t, h, b) for key row b and query position t (dk, dv)
  ScoreGradChain v;         // the chain dv reads: kv, or a copy of its own (own_dv_chain)
};
// The same attention forward by (sequence, head) tiles, for the CPU: f(t, s, h, n) for query
// position t, key position s, head h and sequence n (row n T + t). A schedule computes a whole
// tile's scores and probabilities at once, vectorized over query positions, and every sum over
// positions or head features runs in order, the causal mask applied in the sums over positions
// (masked terms are exact zeros): the bits do not depend on how the loops are tiled. Its
// gradient: AttentionTilesGrad (or attention_grad's rows: both read only out and lse).
struct TileScores {
  Halide::Func q_t;         // q_t(t, d, h, n): the tile's queries, transposed
  Halide::Func dot, score;  // dot(t, s, h, n) = q(t) . k(s); score = dot / sqrt(D)
};
struct AttentionTiles {
  Halide::Func out, lse;          // as in Attention
  TileScores scores, stats;       // the probabilities' chain and the statistics' own one
  Halide::Func row_max, sum_exp;  // (t, h, n)
  Halide::Func tile_lse;          // tile_lse(t, h, n) = row_max + log(sum_exp); lse(h, b) reads it
  Halide::Func prob, keep, kept;  // (t, s, h, n), meaningful for s <= t (the sums mask the rest); keep
                                  // undefined without dropout
  Halide::Func sum;               // sum(d, t, h, n) = sum_s kept(t, s) v(s, d)
};

// Its gradient by the same tiles (CPU): one task per (sequence, head) rebuilds P and dS once for
// the whole [T, T] tile and sums dq, dk and dv of that head from them. Every sum over positions
// runs in order with the causal mask applied in the sum, as in the forward.
struct AttentionTilesGrad {
  Halide::Func dqkv;              // dqkv(c, b) = [dq | dk | dv]: undefined, then every element
                                  // written by an update over `r` (a shared head's once per
                                  // query head of its group)
  Halide::RDom r;                 // (d, t, part, j, kv, n): query head kv G + j, its key / value
                                  // head kv, of sequence n
  Halide::Func delta;             // delta(h, b) (attention_delta), read from its buffer
  TileScores scores;              // q . k, as in AttentionTiles
  TileScores dprob_kept;          // dot(t, s, h, n) = dout(t) . v(s) over the head (q_t: dout transposed)
  Halide::Func prob, keep, kept;  // (t, s, h, n), as in AttentionTiles
  Halide::Func dscore;            // prob * (dprob_kept keep - delta)
  Halide::Func dq, dk, dv;        // (d, t, h, n) sums (dq, dk before the 1 / sqrt(D)): t the query
                                  // position of dq, the key position of dk and dv
};

class CausalAttention {
public:
  explicit CausalAttention(const Sequences &sequences) : L(sequences.L), v(sequences.v), T(sequences.T) {}

  // ---- Causal multi-head self-attention ------------------------------------------------------
  // Attention-dropout element index of P(h, n, t, s): ((n * H + h) * T + t) * T + s, with
  // n = b / T and t = b % T (distinct for every probability of every head of every sequence).
  Halide::Expr attention_element(Halide::Expr s, Halide::Expr h, Halide::Expr b, int H) const {
    using namespace Halide;
    auto u = [](Expr e) { return cast(UInt(64), e); };
    const uint64_t TT = uint64_t(T) * uint64_t(T);
    return u(b / T) * Expr(uint64_t(H) * TT) + u(h) * Expr(TT) + u(b % T) * Expr(uint64_t(T)) + u(s);
  }

  // qkv(c, b) with (H + 2 KV) D features, D = C / H: q = [0, C) in H heads, then k and v in KV
  // heads each (KV = H: [q | k | v] of C each); query head h owns features h D .. h D + D - 1 of
  // q and reads key / value head h / (H / KV) (grouped-query attention).
  // saved_lse: statistics saved by an earlier forward (a recompute then rebuilds the same P from
  // them); out_name: the name of the output Func (default: name).
  Attention attention(const std::string &name, Halide::Func qkv, int C, int H, const Dropout &drop = {},
                      std::optional<Halide::Func> saved_lse = {}, const std::string &out_name = {}, int KV = 0) const {
    using namespace Halide;
    const int D = head_dim(C, H);
    const Heads hd{C, H, KV ? KV : H};
    Attention a{Func(out_name.empty() ? name : out_name), Func(part(name, "sum")), Func(part(name, "lse"))};
    const Expr t = v.b % T;
    // Statistics from their own score chain, so that a schedule computes it per row of lse.
    Scores sl = scores(part(name, "l"), qkv, hd);
    a.lse_dot = sl.dot;
    RDom r(0, T, part(name, "s"));
    r.where(r <= t);  // causal: keys s <= t only
    a.row_max = Func(part(name, "row_max"));
    a.row_max(h, v.b) = sl.score(0, h, v.b);
    a.row_max(h, v.b) = max(a.row_max(h, v.b), sl.score(r, h, v.b));
    a.sum_exp = Func(part(name, "sum_exp"));
    a.sum_exp(h, v.b) = L.constant(0);
    a.sum_exp(h, v.b) += exp(sl.score(r, h, v.b) - a.row_max(h, v.b));
    a.lse(h, v.b) = a.row_max(h, v.b) + log(a.sum_exp(h, v.b));
    Scores sc = scores(name, qkv, hd);
    a.dot = sc.dot;
    a.score = sc.score;
    a.prob = probabilities(name, a.score, saved_lse ? *saved_lse : a.lse);
    dropout_probabilities(name, a.prob, H, drop, a.keep, a.kept);
    RDom r2(0, T, part(name, "sv"));
    r2.where(r2 <= t);
    const Expr n = v.b / T;
    a.sum(v.c, v.b) = L.constant(0);
    a.sum(v.c, v.b) += a.kept(r2, v.c / D, v.b) * qkv(hd.column(2, v.c), n * T + r2);
    a.out(v.c, v.b) = L.store(a.sum(v.c, v.b));
    return a;
  }

  // Vector-Jacobian rule given dout(c, b) and the forward's qkv, out and lse (P is rebuilt as
  // exp(score - lse); no [T, T] tensor is an output). With dropout the same counters give the
  // same mask: dv uses drop(P), dP = (dout . v) * keep / (1 - p), dS = P * (dP - delta) with
  // delta = sum_d dout * out (= sum_s P dP still).
  // Grouped heads (KV < H): a key / value head's gradient sums those of the query heads sharing it.
  // own_dv_chain: dv reads a key-side chain of its own (the same values, computed where dv needs
  // them, apart from dk's).
  AttentionGrad attention_grad(const std::string &name, Halide::Func qkv, Halide::Func out, Halide::Func lse,
                               Halide::Func dout, int C, int H, const Dropout &drop = {}, int KV = 0,
                               bool own_dv_chain = false) const {
    using namespace Halide;
    const int D = head_dim(C, H);
    const Heads hd{C, H, KV ? KV : H};
    AttentionGrad g;
    g.dqkv = Func(name);
    g.dq = Func(part(name, "dq"));
    g.dk = Func(part(name, "dk"));
    g.dv = Func(part(name, "dv"));
    const Expr n = v.b / T, t = v.b % T, scale = L.constant(1 / std::sqrt(double(D)));

    g.delta = attention_delta(name, out, dout, C, H);
    // query side: f(s, h, b) for query row b, key position s; key side: f(t, h, b) for key
    // row b, query position t. Each is indexed by the row where it is consumed.
    g.q = score_grad_chain(part(name, "q"), qkv, lse, dout, g.delta, hd, drop, v.b, n * T + s, s);
    g.kv = score_grad_chain(part(name, "kv"), qkv, lse, dout, g.delta, hd, drop, n * T + s, v.b, t);
    g.v = own_dv_chain ? score_grad_chain(part(name, "v"), qkv, lse, dout, g.delta, hd, drop, n * T + s, v.b, t) : g.kv;

    // dq(b) = sum_{s <= t} dS(s) k(n T + s) / sqrt(D)
    RDom rq(0, T, part(name, "dq_s"));
    rq.where(rq <= t);
    g.dq(v.c, v.b) = L.constant(0);
    g.dq(v.c, v.b) += g.q.dscore(rq, v.c / D, v.b) * qkv(hd.column(1, v.c), n * T + rq) * scale;
    // Key/value row b = n T + s: sums over the queries t' >= s of the same sequence, from the
    // key-side chain (indexed by query position, head and key row); dk and dv by query head.
    RDom rk(0, T, part(name, "dk_t"));
    rk.where(rk >= t);
    g.dk(v.c, v.b) = L.constant(0);
    g.dk(v.c, v.b) += g.kv.dscore(rk, v.c / D, v.b) * qkv(v.c, n * T + rk) * scale;
    RDom rv(0, T, part(name, "dv_t"));
    rv.where(rv >= t);
    g.dv(v.c, v.b) = L.constant(0);
    g.dv(v.c, v.b) += g.v.kept(rv, v.c / D, v.b) * dout(v.c, n * T + rv);

    const int KVD = hd.kv * D;
    g.dqkv(v.c, v.b) = select(v.c < C, g.dq(clamp(v.c, 0, C - 1), v.b), v.c < C + KVD,
                              hd.group_sum(g.dk, clamp(v.c - C, 0, KVD - 1), v.b),
                              hd.group_sum(g.dv, clamp(v.c - C - KVD, 0, KVD - 1), v.b));
    return g;
  }

  // delta(h, b) = sum_d dout * out over the head (named name_delta)
  Halide::Func attention_delta(const std::string &name, Halide::Func out, Halide::Func dout, int C, int H) const {
    const int D = head_dim(C, H);
    Halide::RDom rd(0, D, part(name, "d"));
    Halide::Func delta(part(name, "delta"));
    delta(h, v.b) = L.constant(0);
    delta(h, v.b) += dout(h * D + rd, v.b) * out(h * D + rd, v.b);
    return delta;
  }

  // ---- Causal attention by (sequence, head) tiles (see AttentionTiles) -------------------------
  // Same arguments and results as attention; the whole [T, T] tile of a head is a schedule's
  // working set, so this suits block sizes whose tiles fit a task's stack (the model compiler
  // decides).
  AttentionTiles attention_tiles(const std::string &name, Halide::Func qkv, int C, int H, const Dropout &drop = {},
                                 std::optional<Halide::Func> saved_lse = {}, const std::string &out_name = {},
                                 int KV = 0) const {
    using namespace Halide;
    const int D = head_dim(C, H);
    const Heads hd{C, H, KV ? KV : H};
    AttentionTiles a;
    a.out = Func(out_name.empty() ? name : out_name);
    a.lse = Func(part(name, "lse"));
    a.stats = tile_scores(part(name, "l"), qkv, hd);
    RDom rs(0, T, part(name, "s"));
    a.row_max = Func(part(name, "row_max"));
    a.row_max(t, h, n) = a.stats.score(t, 0, h, n);
    a.row_max(t, h, n) = max(a.row_max(t, h, n), select(rs <= t, a.stats.score(t, rs, h, n), a.row_max(t, h, n)));
    a.sum_exp = Func(part(name, "sum_exp"));
    a.sum_exp(t, h, n) = L.constant(0);
    a.sum_exp(t, h, n) += select(rs <= t, exp(a.stats.score(t, rs, h, n) - a.row_max(t, h, n)), L.constant(0));
    a.tile_lse = Func(part(name, "tile_lse"));
    a.tile_lse(t, h, n) = a.row_max(t, h, n) + log(a.sum_exp(t, h, n));
    a.lse(h, v.b) = a.tile_lse(v.b % T, h, v.b / T);
    // out reads the statistics from their buffer
    tile_probabilities(name, qkv, saved_lse ? *saved_lse : a.lse, hd, drop, a.scores, a.prob, a.keep, a.kept);
    a.sum = tile_sum(
        part(name, "sum"), Causal::keys_of_t, [&](Expr r) { return a.kept(t, r, h, n); }, qkv, hd.offset(2), D,
        hd.group());
    a.out(v.c, v.b) = L.store(a.sum(v.c % D, v.b % T, v.c / D, v.b / T));
    return a;
  }
  // Vector-Jacobian rule of attention_tiles (AttentionTilesGrad), from the forward's qkv, out and
  // lse like attention_grad; rows (a multiple of T) sizes the update's domain, and dqkv is named
  // out_name and holds its values as L.store rounds them.
  // Grouped heads (kv_heads < H): a task per (sequence, key / value head) runs its query heads
  // one after the other, each writing its dq and adding its dk, dv to the shared head's (the
  // first one's value as it is, the others added in head order, as attention_grad's group sum).
  AttentionTilesGrad attention_tiles_grad(const std::string &name, Halide::Func qkv, Halide::Func delta,
                                          Halide::Func lse, Halide::Func dout, int C, int H, const Dropout &drop,
                                          Halide::Expr rows, const std::string &out_name, int kv_heads = 0) const {
    using namespace Halide;
    const int D = head_dim(C, H);
    const Heads hd{C, H, kv_heads ? kv_heads : H};
    const int G = hd.group(), KV = hd.kv;
    const Expr scale = L.constant(1 / std::sqrt(double(D)));
    AttentionTilesGrad g;
    g.delta = delta;
    tile_probabilities(name, qkv, lse, hd, drop, g.scores, g.prob, g.keep, g.kept);
    g.dprob_kept = tile_dots(part(name, "dp"), dout, 0, qkv, hd.offset(2), D, G);
    const Expr dprob =
        drop.enabled ? g.dprob_kept.dot(t, s, h, n) * g.keep(t, s, h, n) : Expr(g.dprob_kept.dot(t, s, h, n));
    g.dscore = Func(part(name, "dscore"));
    g.dscore(t, s, h, n) = g.prob(t, s, h, n) * (dprob - g.delta(h, n * T + t));
    // dq(t) = sum_{s <= t} dS(t, s) k(s) / sqrt(D); dk(s) = sum_{t >= s} dS(t, s) q(t) / sqrt(D);
    // dv(s) = sum_{t >= s} drop(P)(t, s) dout(t). Here t is each Func's own position.
    g.dq = tile_sum(
        part(name, "dq_sum"), Causal::keys_of_t, [&](Expr r) { return g.dscore(t, r, h, n); }, qkv, hd.offset(1), D, G);
    g.dk =
        tile_sum(part(name, "dk_sum"), Causal::queries_of_t, [&](Expr r) { return g.dscore(r, t, h, n); }, qkv, 0, D);
    g.dv = tile_sum(part(name, "dv_sum"), Causal::queries_of_t, [&](Expr r) { return g.kept(r, t, h, n); }, dout, 0, D);
    // over (feature, position, part q / k / v, query head of the group, key / value head, sequence)
    g.r = RDom({{0, D}, {0, T}, {0, 3}, {0, G}, {0, KV}, {0, rows / T}}, part(name, "r"));
    const Expr rd = g.r[0], rt = g.r[1], part = g.r[2], rj = g.r[3], rkv = g.r[4], rn = g.r[5], rh = rkv * G + rj;
    const Expr dk = g.dk(rd, rt, rh, rn) * scale, dv = g.dv(rd, rt, rh, rn);
    g.dqkv = Func(out_name);
    g.dqkv(v.c, v.b) = undef(L.store(L.constant(0)).type());
    const Expr col =
        G == 1 ? part * C + rh * D + rd : select(part == 0, rh * D + rd, C + (part - 1) * KV * D + rkv * D + rd);
    const Expr row = rn * T + rt;
    Expr kv_value = select(part == 1, dk, dv);
    if (G > 1) {  // add to the group's earlier heads
      Expr earlier = g.dqkv(col, row);
      if (L.bf16) earlier = from_bf16_bits(earlier);
      kv_value = select(rj == 0, kv_value, earlier + kv_value);
    }
    g.dqkv(col, row) = L.store(select(part == 0, g.dq(rd, rt, rh, rn) * scale, kv_value));
    return g;
  }

  // The tiles' sums over positions run in tiles of this many positions t
  // (Scheduler::sum_over_positions; see tile_sum).
  static constexpr int sum_tile = 4;

  const Layers &L;
  Vars v;
  int T;
  Halide::Var s{"s"}, h{"h"};  // key position and head of the [T, H, rows] intermediates
  // query position, head feature and sequence of the tiles' Funcs
  Halide::Var t{"t"}, d{"d"}, n{"n"};

private:
  static int head_dim(int C, int H) {
    if (H < 1 || C % H != 0) throw std::invalid_argument("remat: attention width must be a multiple of the head count");
    return C / H;
  }
  // Where the heads sit in a qkv row: H query heads of D = C / H features, then KV key heads and
  // KV value heads; query head h reads key / value head h / (H / KV).
  struct Heads {
    int C, H, kv;
    int D() const { return C / H; }
    int group() const {
      if (kv < 1 || H % kv != 0) throw std::invalid_argument("remat: kv_heads must divide the heads");
      return H / kv;
    }
    // where part 0 (q), 1 (k) or 2 (v) starts
    int offset(int part) const { return part == 0 ? 0 : C + (part - 1) * kv * D(); }
    // the column of part 1 (k) or 2 (v) that query column c (in [0, C)) reads
    Halide::Expr column(int part, Halide::Expr c) const {
      if (group() == 1) return part * C + c;
      return offset(part) + c / D() / group() * D() + c % D();
    }
    // the gradient of k or v column c (in [0, KV D)) from f, by query column: the sum over the
    // query heads of its group (f itself when KV = H)
    Halide::Expr group_sum(Halide::Func f, Halide::Expr c, Halide::Expr b) const {
      const int G = group();
      if (G == 1) return f(c, b);
      Halide::Expr sum = f(c / D() * G * D() + c % D(), b);
      for (int j = 1; j < G; ++j) sum = sum + f((c / D() * G + j) * D() + c % D(), b);
      return sum;
    }
  };
  struct Scores {
    Halide::Func dot, score;
  };
  // q_t(t, d, h, n) = q(h D + d, n T + t); dot(t, s, h, n) = sum_d q_t(t, d) k(C + h D + d, n T + s).
  TileScores tile_scores(const std::string &name, Halide::Func qkv, const Heads &hd) const {
    return tile_dots(name, qkv, 0, qkv, hd.offset(1), hd.D(), hd.group());
  }
  // The same for any two [rows, .] operands: a_t(t, d, h, n) = a(a_offset + h D + d, n T + t),
  // dot(t, s, h, n) = sum_d a_t(t, d) b(b_offset + (h / group) D + d, n T + s), score = dot / sqrt(D).
  TileScores tile_dots(const std::string &name, Halide::Func a, int a_offset, Halide::Func b, int b_offset, int D,
                       int group = 1) const {
    using namespace Halide;
    TileScores sc{Func(part(name, "q_t")), Func(part(name, "dot")), Func(part(name, "score"))};
    RDom rd(0, D, part(name, "qk"));
    sc.q_t(t, d, h, n) = a(a_offset + h * D + d, n * T + t);
    sc.dot(t, s, h, n) = L.constant(0);
    sc.dot(t, s, h, n) += sc.q_t(t, rd, h, n) * b(b_offset + (group == 1 ? h : h / group) * D + rd, n * T + s);
    sc.score(t, s, h, n) = sc.dot(t, s, h, n) * L.constant(1 / std::sqrt(double(D)));
    return sc;
  }

  // A tile's scores and probabilities prob(t, s, h, n) = exp(score - lse(h, n T + t)), with the
  // dropout mask and the kept probabilities (kept = prob without dropout).
  void tile_probabilities(const std::string &name, Halide::Func qkv, Halide::Func lse, const Heads &hd,
                          const Dropout &drop, TileScores &scores, Halide::Func &prob, Halide::Func &keep,
                          Halide::Func &kept) const {
    scores = tile_scores(name, qkv, hd);
    prob = Halide::Func(part(name, "prob"));
    prob(t, s, h, n) = Halide::exp(scores.score(t, s, h, n) - lse(h, n * T + t));
    tile_dropout(name, prob, hd.H, drop, keep, kept);
  }
  // The positions r the causal mask keeps in a sum for position t: the keys of query t (r <= t)
  // or the queries of key t (r >= t).
  enum class Causal { keys_of_t, queries_of_t };
  // sum(d, t, h, n) = sum over the positions r that `causal` keeps of weight(r) x(offset + (h /
  // group) D + d, n T + r), in order (weight(r) an expression of t, r, h, n). The loop over r skips the
  // positions masked for every t of a sum tile; within it the mask's terms are exact zeros, so
  // the bits do not depend on the tiling.
  template <class Weight>
  Halide::Func tile_sum(const std::string &name, Causal causal, Weight weight, Halide::Func x, int offset, int D,
                        int group = 1) const {
    using namespace Halide;
    RDom r(0, T, part(name, "r"));
    const Expr first_of_tile = t / sum_tile * sum_tile;
    const bool keys = causal == Causal::keys_of_t;
    r.where(keys ? r <= first_of_tile + (sum_tile - 1) : r >= first_of_tile);
    Func sum(name);
    sum(d, t, h, n) = L.constant(0);
    sum(d, t, h, n) += select(keys ? r <= t : r >= t, weight(r), L.constant(0)) *
                       x(offset + (group == 1 ? h : h / group) * D + d, n * T + r);
    return sum;
  }
  void tile_dropout(const std::string &name, Halide::Func prob, int H, const Dropout &drop, Halide::Func &keep,
                    Halide::Func &kept) const {
    if (!drop.enabled) {
      kept = prob;
      return;
    }
    keep = Halide::Func(part(name, "keep"));
    keep(t, s, h, n) = dropout_factor(L, drop, attention_element(s, h, drop.row(n * T + t), H));
    kept = Halide::Func(part(name, "kept"));
    kept(t, s, h, n) = prob(t, s, h, n) * keep(t, s, h, n);
  }

  // dot(s, h, b) = sum_d q(h D + d, b) k(of head h, d, n T + s); score = dot / sqrt(D).
  Scores scores(const std::string &name, Halide::Func qkv, const Heads &hd) const {
    using namespace Halide;
    const int D = hd.D();
    Scores sc{Func(part(name, "dot")), Func(part(name, "score"))};
    RDom rd(0, D, part(name, "qk"));
    const Expr n = v.b / T;
    sc.dot(s, h, v.b) = L.constant(0);
    sc.dot(s, h, v.b) += qkv(h * D + rd, v.b) * qkv(hd.column(1, h * D + rd), n * T + s);
    sc.score(s, h, v.b) = sc.dot(s, h, v.b) * L.constant(1 / std::sqrt(double(D)));
    return sc;
  }
  // Probabilities and score gradients for the (query row, key row) pair that `query` and `key`
  // name in terms of (s, h, b); `key_position` is the key's position within its sequence.
  ScoreGradChain score_grad_chain(const std::string &name, Halide::Func qkv, Halide::Func lse, Halide::Func dout,
                                  Halide::Func delta, const Heads &hd, const Dropout &drop, Halide::Expr query,
                                  Halide::Expr key, Halide::Expr key_position) const {
    using namespace Halide;
    const int D = hd.D(), H = hd.H;
    ScoreGradChain c;
    RDom rd(0, D, part(name, "d"));
    c.dot = Func(part(name, "dot"));
    c.dot(s, h, v.b) = L.constant(0);
    c.dot(s, h, v.b) += qkv(h * D + rd, query) * qkv(hd.column(1, h * D + rd), key);
    c.score = Func(part(name, "score"));
    c.score(s, h, v.b) = c.dot(s, h, v.b) * L.constant(1 / std::sqrt(double(D)));
    c.prob = Func(part(name, "prob"));
    c.prob(s, h, v.b) = exp(c.score(s, h, v.b) - lse(h, query));
    if (drop.enabled) {
      c.keep = Func(part(name, "keep"));
      c.keep(s, h, v.b) = dropout_factor(L, drop, attention_element(key_position, h, drop.row(query), H));
      c.kept = Func(part(name, "kept"));
      c.kept(s, h, v.b) = c.prob(s, h, v.b) * c.keep(s, h, v.b);
    } else {
      c.kept = c.prob;
    }
    c.dprob_kept = Func(part(name, "dprob_kept"));
    c.dprob_kept(s, h, v.b) = L.constant(0);
    c.dprob_kept(s, h, v.b) += dout(h * D + rd, query) * qkv(hd.column(2, h * D + rd), key);
    c.dprob = Func(part(name, "dprob"));
    c.dprob(s, h, v.b) = drop.enabled ? c.dprob_kept(s, h, v.b) * c.keep(s, h, v.b) : Expr(c.dprob_kept(s, h, v.b));
    c.dscore = Func(part(name, "dscore"));
    c.dscore(s, h, v.b) = c.prob(s, h, v.b) * (c.dprob(s, h, v.b) - delta(h, query));
    return c;
  }
  Halide::Func probabilities(const std::string &name, Halide::Func score, Halide::Func lse) const {
    Halide::Func p(part(name, "prob"));
    p(s, h, v.b) = Halide::exp(score(s, h, v.b) - lse(h, v.b));
    return p;
  }
  void dropout_probabilities(const std::string &name, Halide::Func prob, int H, const Dropout &d, Halide::Func &keep,
                             Halide::Func &kept) const {
    if (!d.enabled) {
      kept = prob;
      return;
    }
    keep = Halide::Func(part(name, "keep"));
    keep(s, h, v.b) = dropout_factor(L, d, attention_element(s, h, d.row(v.b), H));
    kept = Halide::Func(part(name, "kept"));
    kept(s, h, v.b) = prob(s, h, v.b) * keep(s, h, v.b);
  }
};

}  // namespace remat::gen
