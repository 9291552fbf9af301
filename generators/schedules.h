// Schedule templates, one per kernel shape (GEMM, pointwise, row and column reductions,
// attention, embedding, loss, optimizer), for the CPU and for GPUs (chosen by the target; GPU
// kernels leave their GEMMs to a library, see Gemms in dsl/tensors.cppm).
// The model compiler gives every Func of a given role the same one in every kernel variant, so a
// recomputed value is bit-identical to the one computed the first time; bench/bench_gemm.cpp
// times the CPU GEMM template against OpenBLAS.
//
// No schedule allocates: every intermediate a kernel keeps is a planned arena buffer (a kernel
// output) or lives in registers / GPU shared memory with a constant size.
#pragma once

#include "attention.h"
#include "layers.h"

#include <Halide.h>

#include <optional>
#include <stdexcept>
#include <vector>

namespace remat::gen {

class Scheduler {
  using Func = Halide::Func;
  using Var = Halide::Var;
  using RVar = Halide::RVar;
  using TailStrategy = Halide::TailStrategy;
  using Target = Halide::Target;
  using Stage = Halide::Stage;
  using LoopLevel = Halide::LoopLevel;

public:
  Scheduler(const Target &target, const Vars &v)
      : v(v), vec(target.natural_vector_size<float>()), gpu(target.has_gpu_feature()) {}

  // Register tiles of tile_c x tile_b outputs accumulate over the whole inner dimension. Tiles
  // never run past a static extent (tile sizes divide it), and a dynamic row count (the batch)
  // uses overlapping last tiles (ShiftInwards), which needs rows >= min_batch.
  static constexpr int min_batch = 8;
  // `computed`: an operand a(k, b) that is not in memory (e.g. a LayerNorm output); it is
  // computed once per row tile, which then runs through every column tile.
  void matmul(MatMul &m, int rows /* -1: the batch */, int cols, std::optional<Func> computed = {}) {
    Var co("co"), bo("bo"), ci("ci"), bi("bi");
    if (gpu) throw std::logic_error("GPU kernels run their GEMMs in a library (Gemms::library)");
    int tile_c = 0, tile_b = 1;
    for (int t : {2 * vec, vec})
      if (!tile_c && cols % t == 0) tile_c = t;
    for (int t : {6, 4, 2})
      if (tile_b == 1 && (rows < 0 ? t <= min_batch : rows % t == 0)) tile_b = t;
    const TailStrategy row_tail = rows < 0 ? TailStrategy::ShiftInwards : TailStrategy::GuardWithIf;
    if (!tile_c) {  // narrow outputs (e.g. 10 classes): whole rows, scalar
      m.out.compute_root().split(v.b, bo, bi, tile_b, row_tail).reorder(v.c, bi, bo).parallel(bo);
      m.acc.compute_at(m.out, bo);
      m.acc.update().reorder(v.c, v.b, m.k);
      return;
    }
    m.out.compute_root()
        .split(v.c, co, ci, tile_c, TailStrategy::GuardWithIf)
        .split(v.b, bo, bi, tile_b, row_tail)
        .vectorize(ci, vec)
        .unroll(ci)
        .unroll(bi);
    if (computed) {
      m.out.reorder(ci, bi, co, bo).parallel(bo);
      computed->compute_at(m.out, bo).vectorize(v.c, vec, TailStrategy::GuardWithIf);
    } else {
      m.out.reorder(ci, bi, bo, co).parallel(co);
    }
    // the accumulator tile lives in registers inside the innermost tile loop
    m.acc.compute_at(m.out, computed ? co : bo).vectorize(v.c, vec).unroll(v.c).unroll(v.b);
    m.acc.update().reorder(v.c, v.b, m.k).vectorize(v.c, vec).unroll(v.c).unroll(v.b);
  }
  void pointwise(Func f) {
    Var co("co"), ci("ci"), bo("bo"), bi("bi");
    if (gpu) {
      f.compute_root().gpu_tile(v.c, v.b, co, bo, ci, bi, 32, 8, TailStrategy::GuardWithIf);
      return;
    }
    f.compute_root()
        .split(v.c, co, ci, vec, TailStrategy::GuardWithIf)
        .vectorize(ci)
        .parallel(v.b, 8, TailStrategy::GuardWithIf);
  }
  void transpose(Func f) {
    Var co("co"), ci("ci"), bo("bo"), bi("bi");
    if (gpu) return pointwise(f);
    f.compute_root()
        .tile(v.c, v.b, co, bo, ci, bi, vec, vec, TailStrategy::GuardWithIf)
        .vectorize(ci)
        .unroll(bi)
        .parallel(bo);
  }
  // f(b) = g(reduction over the features of row b); `partial` are the row reductions it reads
  void row_reduction(Func f, std::vector<Func> partial = {}) {
    if (gpu) {  // a thread per row
      Var bo("bo"), bi("bi");
      f.compute_root().gpu_tile(v.b, bo, bi, 64, TailStrategy::GuardWithIf);
      if (f.has_update_definition()) f.update().gpu_tile(v.b, bo, bi, 64, TailStrategy::GuardWithIf);
      for (Func &p : partial) p.compute_at(f, bi);
      return;
    }
    // CPU: a task per 2 vectors of rows, each lane summing its own row in order (the order of a
    // loop per row, so the bits do not depend on the vector width); the partial sums of a task
    // on its stack (constant size also for a last, shorter task)
    const Var bo("bo"), bi("bi");
    const int rows_per_task = 2 * vec;
    f.compute_root().split(v.b, bo, bi, rows_per_task, TailStrategy::GuardWithIf).parallel(bo).vectorize(bi, vec);
    if (f.has_update_definition())
      f.update()
          .split(v.b, bo, bi, rows_per_task, TailStrategy::GuardWithIf)
          .reorder(bi, f.rvars(0)[0], bo)
          .parallel(bo)
          .vectorize(bi, vec);
    for (Func &p : partial) {
      p.compute_at(f, bo).bound_storage(v.b, rows_per_task).vectorize(v.b, vec, TailStrategy::GuardWithIf);
      p.update().reorder(v.b, p.rvars(0)[0]).vectorize(v.b, vec, TailStrategy::GuardWithIf);
    }
  }
  // A dot product f(s, h, b) over a head's `width` features. CPU: the products accumulate
  // lane-wise, one vector per (position, head) (an rfactor over vector lanes, computed per head),
  // and the lanes are then added in order. The kernels are strict_float (CMakeLists.txt), so that
  // order is the same wherever the Func is compiled. A width that is no multiple of the vector
  // width (or none given) stays a plain loop. On a GPU the product stays a loop within its thread.
  void dot(Func f, int width = 0) {
    if (gpu || width == 0 || width % vec != 0) return;
    RVar rdo("rdo"), rdi("rdi");
    const Var u("u"), s("s"), h("h");
    Func lanes = f.update().split(f.rvars(0)[0], rdo, rdi, vec).rfactor(rdi, u);
    f.update().reorder(rdi, s, h).unroll(rdi);
    lanes.compute_at(f, h).reorder_storage(u, s, h, v.b).vectorize(u);
    lanes.update().reorder(u, rdo, s).vectorize(u);
  }
  // out(c, b) = sum over positions of weights(., c / D, b) * rows(c): vectors along c.
  void weighted_sum(Func f) {
    if (!gpu) f.update().vectorize(v.c, vec, TailStrategy::GuardWithIf);
  }
  // out(c) = epilogue(sum over rows of ...): `sum` is computed vector by vector inside `out`
  void column_sum(Func out, Func sum, RVar rows, int cols) {
    Var co("co"), ci("ci");
    if (gpu) {  // a thread per column runs down the rows
      out.compute_root().gpu_tile(v.c, co, ci, 64, TailStrategy::GuardWithIf);
      sum.compute_at(out, ci);
      return;
    }
    if (cols % vec != 0) {  // narrow: scalar columns
      out.compute_root();
      sum.compute_at(out, v.c);
      return;
    }
    out.compute_root().split(v.c, co, ci, vec).vectorize(ci).parallel(co);
    sum.compute_at(out, co).vectorize(v.c);
    sum.update().reorder(v.c, rows).vectorize(v.c);
  }

  // Causal attention forward. CPU: a row per task, the head dot products vectorized. GPU: a
  // thread block per (row, head), rows on the grid's x axis (up to 2^31 - 1 blocks; y and z stop
  // at 65,535), heads on y; the row's scores and probabilities for that head sit in shared
  // memory (T floats each), its threads run over key positions, then over the head's features.
  // `lse_computed`: the statistics are computed here (not read from a saved buffer).
  void attention(gen::Attention &a, bool lse_computed, int head_dim, int block_size) {
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
    if (lse_computed) {
      a.lse.compute_root().parallel(v.b);
      a.lse_dot.compute_at(a.lse, v.b);
      a.row_max.compute_at(a.lse, v.b);
      a.sum_exp.compute_at(a.lse, v.b);
      dot(a.lse_dot, head_dim);
    }
    a.out.compute_root().parallel(v.b).vectorize(v.c, vec, TailStrategy::GuardWithIf);
    a.sum.compute_at(a.out, v.b).vectorize(v.c, vec, TailStrategy::GuardWithIf);
    weighted_sum(a.sum);
    a.dot.compute_at(a.out, v.b);
    a.kept.compute_at(a.out, v.b);
    dot(a.dot, head_dim);
  }
  // delta(h, b) = dout . out over each head: a row per task (CPU) or thread (GPU).
  void attention_delta(Func delta) {
    const Var h("h");
    if (gpu) {
      Var bo("bo"), bi("bi");
      delta.compute_root().reorder(h, v.b).gpu_tile(v.b, bo, bi, 64, TailStrategy::GuardWithIf);
      delta.update().reorder(delta.rvars(0)[0], h, v.b).gpu_tile(v.b, bo, bi, 64, TailStrategy::GuardWithIf);
      return;
    }
    delta.compute_root().parallel(v.b);
    delta.update().parallel(v.b);
    dot(delta);
  }
  // The attention input gradient dqkv(c, b), consumed by `consumer` (the tensor's gradient).
  // CPU: both score-gradient chains per row. GPU: a block per (row, head of q, k or v), rows on
  // the grid's x axis, as in attention; the chains for that head live in shared memory with
  // threads over positions.
  void attention_grad(Func consumer, gen::AttentionGrad g, int head_dim, int block_size) {
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
    consumer.compute_root().parallel(v.b);
    for (Func fn :
         {g.dq, g.dk, g.dv, g.q.dot, g.q.dprob_kept, g.q.dscore, g.kv.dot, g.kv.dprob_kept, g.kv.dscore, g.kv.kept})
      fn.compute_at(consumer, v.b);
    for (Func fn : {g.q.dot, g.q.dprob_kept, g.kv.dot, g.kv.dprob_kept}) dot(fn, head_dim);
    for (Func fn : {g.dq, g.dk, g.dv}) {
      fn.vectorize(v.c, vec, TailStrategy::GuardWithIf);
      weighted_sum(fn);
    }
  }
  // Whether every tile buffer ([T, T] and [T, D] floats) fits Halide's stack allocations (16 KiB:
  // beyond that Halide's "stack" memory comes from the heap, which no kernel may use).
  // Halide keeps a constant-size buffer on the stack up to 16 KiB, and takes larger ones from the
  // heap (which no kernel may do): buffers a schedule puts on the stack must fit this.
  static bool fits_stack(long long bytes) { return bytes <= 16 * 1024; }
  static bool attention_tiles_fit(int C, int H, int T) {
    return fits_stack(4LL * T * T) && fits_stack(4LL * T * (C / H));
  }
  // A small [width, height] table computed once per kernel call, before everything else.
  void table(Func f, int width, int height) {
    f.compute_root().bound(v.c, 0, width).bound(v.b, 0, height).store_in(Halide::MemoryType::Stack);
  }
  // Causal attention forward by (sequence, head) tiles (CPU): a task per (sequence, head). The
  // tile's transposed queries, scores or probabilities and row statistics live on the task's
  // stack ([T, T] floats at most), computed in register tiles vectorized over query positions;
  // the sums over key positions run in register tiles vectorized over head features. Output
  // rows are whole sequences (align_bounds: the tensor's consumers ask for them anyway).
  void attention_tiles(gen::AttentionTiles &a, bool lse_computed, int head_dim, int block_size) {
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
        positions(f);
        positions(f.update().reorder(t, f.rvars(0)[0]));
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
  void attention_tiles_grad(gen::AttentionTilesGrad &g, int head_dim, int block_size) {
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
      positions(g.keep);
    }
    tile_of_scores(g.dscore, g.dprob_kept, task, block_size);
    for (Func f : {g.dq, g.dk, g.dv}) {
      f.compute_at(task).store_in(Halide::MemoryType::Stack);
      sum_over_positions(f, head_dim, block_size);
    }
  }
  // Embedding gradients: the token table is a scatter-add over rows (serial in the rows, so
  // deterministic), vectorized (CPU) or a thread per feature (GPU); the position table sums the
  // sequences of each position.
  void embedding_grad(gen::EmbeddingGrad g) {
    Var co("co"), ci("ci"), bo("bo"), bi("bi");
    if (gpu) {
      g.dwte.compute_root().gpu_tile(v.c, v.b, co, bo, ci, bi, 32, 8, TailStrategy::GuardWithIf);
      g.dwte.update().gpu_tile(v.c, co, ci, 64, TailStrategy::GuardWithIf);
      g.dwpe.compute_root().gpu_tile(v.c, v.b, co, bo, ci, bi, 32, 8, TailStrategy::GuardWithIf);
      g.dwpe.update().gpu_tile(v.c, v.b, co, bo, ci, bi, 32, 8, TailStrategy::GuardWithIf);
      return;
    }
    g.dwte.compute_root().vectorize(v.c, vec, TailStrategy::GuardWithIf);
    g.dwte.update().vectorize(v.c, vec, TailStrategy::GuardWithIf);
    g.dwpe.compute_root().vectorize(v.c, vec, TailStrategy::GuardWithIf).parallel(v.b);
    g.dwpe.update().vectorize(v.c, vec, TailStrategy::GuardWithIf).parallel(v.b);
  }
  void cross_entropy(Layers::CrossEntropy ce) {
    Var bo("bo"), bi("bi");
    if (gpu) {
      for (Func f : {ce.row_max, ce.row_lse, ce.row_loss, ce.row_correct}) {
        f.compute_root().gpu_tile(v.b, bo, bi, 64, TailStrategy::GuardWithIf);
        if (f.has_update_definition()) f.update().gpu_tile(v.b, bo, bi, 64, TailStrategy::GuardWithIf);
      }
      ce.sum_exp.compute_at(ce.row_lse, bi);
    } else {
      ce.row_max.compute_root().parallel(v.b, 16, TailStrategy::GuardWithIf);
      ce.row_max.update().parallel(v.b, 16, TailStrategy::GuardWithIf);
      ce.row_lse.compute_root().parallel(v.b, 16, TailStrategy::GuardWithIf);
      ce.sum_exp.compute_at(ce.row_lse, v.b);
      for (Func f : {ce.row_loss, ce.row_correct}) f.compute_root().parallel(v.b, 16, TailStrategy::GuardWithIf);
    }
    pointwise(ce.dlogits);
  }
  // A flat 1-D elementwise Func (AdamW, parameter copies).
  void flat(Func upd) {
    Var co("co"), ci("ci");
    if (gpu) {
      upd.compute_root().gpu_tile(v.c, co, ci, 256, TailStrategy::GuardWithIf);
      return;
    }
    upd.compute_root()
        .split(v.c, co, ci, vec * 64, TailStrategy::GuardWithIf)
        .parallel(co)
        .vectorize(ci, vec, TailStrategy::GuardWithIf);
  }

  const Vars &v;
  int vec;
  bool gpu;

private:
  // The largest of `sizes` that divides `extent` (1 when none does).
  static int dividing(int extent, std::initializer_list<int> sizes) {
    for (int size : sizes)
      if (extent % size == 0) return size;
    return 1;
  }
  // f(t, ...) vectorized over query positions t where whole vectors fit.
  template <class S>
  void positions(S &&f) {
    f.vectorize(Var("t"), vec, TailStrategy::GuardWithIf);
  }
  // f(t, s, h, n), a tile's [T, T] values from the dot products of `sc`, computed at the loop
  // `at` on the stack, in register tiles of (two) vectors of query positions by (four)
  // key positions; each tile's dot products accumulate over the head in registers.
  void tile_of_scores(Func f, gen::TileScores sc, LoopLevel at, int T) {
    const Var t("t"), s("s"), to("to"), ti("ti"), so("so"), si("si");
    const int tile_t = dividing(T, {2 * vec, vec}), tile_s = dividing(T, {4, 2});
    sc.q_t.compute_at(at).store_in(Halide::MemoryType::Stack);
    positions(sc.q_t);
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
    update.split(t, to, ti, dividing(T, {gen::Transformer::sum_tile, 2}))
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
};

}  // namespace remat::gen
