// CPU schedule templates, one per kernel shape (GEMM, pointwise, row and column reductions,
// attention dot products). The model compiler gives every Func of a given role the same one in
// every kernel variant, so a recomputed value is bit-identical to the one computed the first
// time; bench/bench_gemm.cpp times the GEMM template against OpenBLAS.
#pragma once

#include "layers.h"

#include <Halide.h>

#include <optional>
#include <vector>

namespace remat::gen {

class Scheduler {
  using Func = Halide::Func;
  using Var = Halide::Var;
  using RVar = Halide::RVar;
  using TailStrategy = Halide::TailStrategy;
  using Target = Halide::Target;

public:
  Scheduler(const Target &target, const Vars &v)
      : v(v), vec(target.natural_vector_size<float>()) {}

  // Register tiles of tile_c x tile_b outputs accumulate over the whole inner dimension. Tiles
  // never run past a static extent (tile sizes divide it), and a dynamic row count (the batch)
  // uses overlapping last tiles (ShiftInwards), which needs rows >= min_batch.
  static constexpr int min_batch = 8;
  // `computed`: an operand a(k, b) that is not in memory (e.g. a LayerNorm output); it is
  // computed once per row tile, which then runs through every column tile.
  void matmul(MatMul &m, int rows /* -1: the batch */, int cols, std::optional<Func> computed = {}) {
    Var co("co"), bo("bo"), ci("ci"), bi("bi");
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
    Var co("co"), ci("ci");
    f.compute_root().split(v.c, co, ci, vec, TailStrategy::GuardWithIf).vectorize(ci).parallel(v.b, 8, TailStrategy::GuardWithIf);
  }
  void transpose(Func f) {
    Var co("co"), ci("ci"), bo("bo"), bi("bi");
    f.compute_root()
        .tile(v.c, v.b, co, bo, ci, bi, vec, vec, TailStrategy::GuardWithIf)
        .vectorize(ci)
        .unroll(bi)
        .parallel(bo);
  }
  // f(b) = g(reduction over the features of row b); `partial` are the row reductions it reads
  void row_reduction(Func f, std::vector<Func> partial = {}) {
    f.compute_root().parallel(v.b, 16, TailStrategy::GuardWithIf);
    if (f.has_update_definition()) f.update().parallel(v.b, 16, TailStrategy::GuardWithIf);
    for (Func &p : partial) p.compute_at(f, v.b);
  }
  // A dot product over a head's features: the reduction itself is vectorized (vector partial
  // sums, then a horizontal add).
  void dot(Func f) { f.update().atomic().vectorize(f.rvars(0)[0], vec); }
  // out(c, b) = sum over positions of weights(., c / D, b) * rows(c): vectors along c.
  void weighted_sum(Func f) { f.update().vectorize(v.c, vec, TailStrategy::GuardWithIf); }
  // out(c) = epilogue(sum over rows of ...): `sum` is computed vector by vector inside `out`
  void column_sum(Func out, Func sum, RVar rows, int cols) {
    Var co("co"), ci("ci");
    if (cols % vec != 0) {  // narrow: scalar columns
      out.compute_root();
      sum.compute_at(out, v.c);
      return;
    }
    out.compute_root().split(v.c, co, ci, vec).vectorize(ci).parallel(co);
    sum.compute_at(out, co).vectorize(v.c);
    sum.update().reorder(v.c, rows).vectorize(v.c);
  }

  const Vars &v;
  int vec;
};

}  // namespace remat::gen
