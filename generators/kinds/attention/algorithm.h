// The attention kind's algorithm: causal multi-head (or grouped-query) self-attention on fused
// [q | k | v] rows, forward with a per-row log-sum-exp and a FlashAttention-style backward that
// rebuilds the probabilities from it, by rows (the GPU kernels'; the CPU kernels call the
// runtime's blocked attention, runtime/attention.cpp), dropout on the probabilities from the
// counter-based RNG. Same conventions as layers.h: element
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

  const Layers &L;
  Vars v;
  int T;
  Halide::Var s{"s"}, h{"h"};  // key position and head of the [T, H, rows] intermediates

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
