// The attention kind's schedules, for the CPU and for GPUs (by the target, as Scheduler's): by rows,
// and by (sequence, head) tiles on the CPU where their buffers fit a task's stack.
#pragma once

#include <Halide.h>

#include "kinds/attention/algorithm.h"
#include "schedules.h"

#include <algorithm>

namespace remat::gen {

class AttentionSchedule {
  using Func = Halide::Func;
  using Var = Halide::Var;
  using RVar = Halide::RVar;
  using TailStrategy = Halide::TailStrategy;
  using Stage = Halide::Stage;
  using LoopLevel = Halide::LoopLevel;

public:
  explicit AttentionSchedule(Scheduler &scheduler)
      : sched(scheduler), v(scheduler.v), vec(scheduler.vec), gpu(scheduler.gpu) {}

  // Whether every tile buffer ([T, T] and [T, D] floats) fits Halide's stack allocations
  // (Scheduler::fits_stack).
  static bool tiles_fit(int C, int H, int T) {
    return Scheduler::fits_stack(4LL * T * T) && Scheduler::fits_stack(4LL * T * (C / H));
  }
  // Causal attention forward. CPU: a row per task, the head dot products vectorized. GPU: a
  // thread block per (row, head), rows on the grid's x axis (up to 2^31 - 1 blocks; y and z stop
  // at 65,535), heads on y; the row's scores and probabilities for that head sit in shared
  // memory (T floats each), its threads run over key positions, then over the head's features.
  // `lse_computed`: the statistics are computed here (not read from a saved buffer).
  void forward(Attention &a, bool lse_computed, int head_dim, int block_size) {
    Var co("co"), ci("ci"), bo("bo"), bi("bi");
    const Var h("h");
    if (gpu) {
      if (lse_computed) {  // a thread per (row, head) walks the keys
        a.lse.compute_root().reorder(h, v.b).gpu_tile(v.b, bo, bi, 64, TailStrategy::GuardWithIf);
        for (Func f : {a.row_max, a.sum_exp, a.lse_dot}) f.compute_at(a.lse, h);
      }
      a.out.compute_root().split(v.c, co, ci, head_dim).reorder(ci, v.b, co).gpu_blocks(v.b, co).gpu_threads(ci);
      a.sum.compute_at(a.out, ci);  // a thread's own output element, in a register
      // at the innermost block loop (the row): per (row, head)
      for (Func f : {a.dot, a.kept}) positions_in_shared_memory(f, a.out, v.b, block_size);
      return;
    }
    // CPU: a row per task, its heads one after the other, so that a row's buffers hold one
    // head's T values (fits_stack: at most 4096 positions, rules.h)
    const Var ho("ho"), d("d");
    if (lse_computed) {
      a.lse.compute_root().parallel(v.b);
      for (Func f : {a.lse_dot, a.row_max, a.sum_exp}) f.compute_at(a.lse, h);
      sched.dot(a.lse_dot, head_dim);
    }
    a.out.compute_root().split(v.c, ho, d, head_dim).parallel(v.b).vectorize(d, vec, TailStrategy::GuardWithIf);
    a.sum.compute_at(a.out, ho).vectorize(v.c, vec, TailStrategy::GuardWithIf);
    sched.weighted_sum(a.sum);
    a.dot.compute_at(a.out, ho);
    a.kept.compute_at(a.out, ho);
    sched.dot(a.dot, head_dim);
  }
  // delta(h, b) = dout . out over each head: a row per task (CPU) or thread (GPU).
  void delta(Func delta) {
    const Var h("h");
    if (gpu) {
      Var bo("bo"), bi("bi");
      delta.compute_root().reorder(h, v.b).gpu_tile(v.b, bo, bi, 64, TailStrategy::GuardWithIf);
      delta.update().reorder(delta.rvars(0)[0], h, v.b).gpu_tile(v.b, bo, bi, 64, TailStrategy::GuardWithIf);
      return;
    }
    delta.compute_root().parallel(v.b, Scheduler::rows_per_task, TailStrategy::GuardWithIf);
    delta.update().parallel(v.b, Scheduler::rows_per_task, TailStrategy::GuardWithIf);
    sched.dot(delta);
  }
  // The attention input gradient dqkv(c, b), consumed by `consumer` (the tensor's gradient).
  // CPU: see below. GPU: a block per (row, head of q, k or v), rows on
  // the grid's x axis, as in attention; the chains for that head live in shared memory with
  // threads over positions.
  void grad(Func consumer, AttentionGrad g, int head_dim, int block_size) {
    if (gpu) {
      Var co("co"), ci("ci"), si("si");
      consumer.compute_root().split(v.c, co, ci, head_dim).reorder(ci, v.b, co).gpu_blocks(v.b, co).gpu_threads(ci);
      // at the innermost block loop (the row): per (row, head)
      for (Func f : {g.dq, g.dk, g.dv}) {
        f.compute_at(consumer, v.b).gpu_threads(v.c);
        f.update().gpu_threads(v.c);
      }
      for (Func f : {g.q.dscore, g.kv.dot, g.kv.kept, g.kv.dscore})
        positions_in_shared_memory(f, consumer, v.b, block_size);
      for (Func f : {g.q.dot, g.q.dprob_kept}) f.compute_at(g.q.dscore, si);
      g.kv.dprob_kept.compute_at(g.kv.dscore, si);
      return;
    }
    // CPU: a row per task; dq, dk and dv of the row head by head, each head's score-gradient
    // chain computed there (T values a buffer; dv has a chain of its own, rebuilding the
    // probabilities, so that no buffer holds every head's)
    consumer.compute_root().parallel(v.b);
    const Var ho("ho"), d("d");
    const auto by_heads = [&](Func sum, std::initializer_list<Func> chain) {
      sum.compute_at(consumer, v.b).vectorize(v.c, vec, TailStrategy::GuardWithIf);
      sum.update().split(v.c, ho, d, head_dim).vectorize(d, vec, TailStrategy::GuardWithIf);
      for (Func fn : chain) fn.compute_at(sum, ho);
    };
    by_heads(g.dq, {g.q.dot, g.q.dprob_kept, g.q.dscore});
    by_heads(g.dk, {g.kv.dot, g.kv.dprob_kept, g.kv.dscore});
    by_heads(g.dv, {g.v.dot, g.v.kept});
    for (Func fn : {g.q.dot, g.q.dprob_kept, g.kv.dot, g.kv.dprob_kept, g.v.dot}) sched.dot(fn, head_dim);
  }
  // Causal attention forward by (sequence, head) tiles (CPU): a task per (sequence, head). The
  // tile's transposed queries, scores or probabilities and row statistics live on the task's
  // stack ([T, T] floats at most), computed in register tiles vectorized over query positions;
  // the sums over key positions run in register tiles vectorized over head features. Output
  // rows are whole sequences (align_bounds: the tensor's consumers ask for them anyway).
  void tiles(AttentionTiles &a, bool lse_computed, int head_dim, int block_size) {
    const Var t("t"), h("h"), n("n"), hn("hn"), d("d");
    if (lse_computed) {
      a.lse.compute_root()
          .align_bounds(v.b, block_size)
          .split(v.b, n, t, block_size, TailStrategy::RoundUp)
          .reorder(t, h, n)
          .fuse(h, n, hn)
          .parallel(hn);
      tile_of_scores(a.stats.score, a.stats, LoopLevel(a.lse, hn), block_size);
      for (Func f : {a.row_max, a.sum_exp}) {
        f.compute_at(a.lse, hn).store_in(Halide::MemoryType::Stack);
        sched.positions(f);
        sched.positions(f.update().reorder(t, f.rvars(0)[0]));
      }
    }
    a.out.compute_root()
        .align_bounds(v.b, block_size)
        .split(v.b, n, t, block_size, TailStrategy::RoundUp)
        .split(v.c, h, d, head_dim)
        .reorder(d, t, h, n)
        .fuse(h, n, hn)
        .parallel(hn);
    if (head_dim % vec == 0) a.out.vectorize(d, vec);
    tile_of_scores(a.kept, a.scores, LoopLevel(a.out, hn), block_size);
    a.sum.compute_at(a.out, hn).store_in(Halide::MemoryType::Stack);
    sum_over_positions(a.sum, head_dim, block_size);
  }
  // Its gradient by the same tiles (CPU): the update that writes dqkv runs a task per (sequence,
  // head); the task's (query head's) P (and dropout mask), dS and dq, dk, dv sums live on its stack, P and dS
  // in the register tiles of the forward's scores, the sums in those of its P . V.
  // With grouped heads a task is a (sequence, key / value head), which runs its query heads one
  // after the other (each one's buffers computed at that loop, so a task's stack holds one head's).
  void tiles_grad(AttentionTilesGrad &g, int head_dim, int block_size) {
    const RVar hn("hn");
    Stage write = g.dqkv.update();
    write
        .allow_race_conditions()  // every element is written by one task only
        .fuse(g.r[4], g.r[5], hn)
        .parallel(hn)
        .unroll(g.r[2]);
    if (head_dim % vec == 0) write.vectorize(g.r[0], vec);
    const LoopLevel task(g.dqkv, g.r[3]);
    tile_of_scores(g.prob, g.scores, task, block_size);
    if (g.keep.defined()) {
      g.keep.compute_at(task).store_in(Halide::MemoryType::Stack);
      sched.positions(g.keep);
    }
    tile_of_scores(g.dscore, g.dprob_kept, task, block_size);
    for (Func f : {g.dq, g.dk, g.dv}) {
      f.compute_at(task).store_in(Halide::MemoryType::Stack);
      sum_over_positions(f, head_dim, block_size);
    }
  }

private:
  // f(t, s, h, n), a tile's [T, T] values from the dot products of `sc`, computed at the loop
  // `at` on the stack, in register tiles of (two) vectors of query positions by (four)
  // key positions; each tile's dot products accumulate over the head in registers.
  void tile_of_scores(Func f, gen::TileScores sc, LoopLevel at, int T) {
    const Var t("t"), s("s"), to("to"), ti("ti"), so("so"), si("si");
    const int tile_t = sched.dividing(T, {2 * vec, vec}), tile_s = sched.dividing(T, {4, 2});
    sc.q_t.compute_at(at).store_in(Halide::MemoryType::Stack);
    sched.positions(sc.q_t);
    f.compute_at(at)
        .store_in(Halide::MemoryType::Stack)
        .split(t, to, ti, tile_t)
        .split(s, so, si, tile_s)
        .reorder(ti, si, to, so)
        .unroll(si);
    sc.dot.compute_at(f, to).unroll(s);
    sc.dot.update().reorder(t, s, sc.dot.rvars(0)[0]).unroll(s);
    if (tile_t % vec == 0) {
      f.vectorize(ti, vec).unroll(ti);
      sc.dot.vectorize(t, vec).unroll(t);
      sc.dot.update().vectorize(t, vec).unroll(t);
    }
  }
  // sum(d, t, ...) += w(t, r) x(r, d) over positions r, computed whole where it is: its update in
  // register tiles of (four) positions t by the head's features d, vectorized over the features.
  void sum_over_positions(Func sum, int head_dim, int T) {
    const Var t("t"), d("d"), to("to"), ti("ti");
    Stage update = sum.update();
    update.split(t, to, ti, sched.dividing(T, {CausalAttention::sum_tile, 2}))
        .reorder(d, ti, sum.rvars(0)[0], to)
        .unroll(ti);
    if (head_dim % vec == 0) {
      sum.vectorize(d, vec);
      update.vectorize(d, vec).unroll(d);
    }
  }
  // GPU: f(s, h, b), one row's values over key positions s for one head, computed in shared
  // memory at the thread-block loop `at` of `consumer`, threads over positions (vars so, si).
  static void positions_in_shared_memory(Func f, Func consumer, Var at, int block_size) {
    const Var s("s"), so("so"), si("si");
    const int threads = std::min(block_size, 128);
    f.compute_at(consumer, at).split(s, so, si, threads, TailStrategy::GuardWithIf).gpu_threads(si);
    if (f.has_update_definition()) f.update().split(s, so, si, threads, TailStrategy::GuardWithIf).gpu_threads(si);
  }

  Scheduler &sched;
  const Vars &v;
  int vec;
  bool gpu;
};

}  // namespace remat::gen
