// Schedule templates, one per kernel shape (pointwise, row and column reductions, attention,
// embedding, loss, optimizer), for the CPU and for GPUs (chosen by the target; every GEMM runs in
// a library: MKL, cuBLASLt). The model compiler gives every Func of a given role the same one in
// every kernel variant, so a recomputed value is bit-identical to the one computed the first time.
//
// No schedule allocates: every intermediate a kernel keeps is a planned arena buffer (a kernel
// output) or lives in registers / GPU shared memory with a constant size.
#pragma once

#include "layers.h"

#include <Halide.h>

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

  // Rows per parallel task of row-wise loops (pointwise Funcs, per-row statistics): Halide's
  // thread pool hands out a parallel loop's iterations one at a time under one mutex, so a task
  // must be worth a lock hand-off between cores (2048 rows: 64 tasks).
  static constexpr int rows_per_task = 32;
  // A GPU thread block of 32 columns x 8 rows of `s` over (c, b), the blocks' rows on the grid's x
  // axis (up to 2^31 - 1 blocks; y and z stop at 65,535, which would stop rows at 524,280: batch
  // 64 x context 8191), columns on y.
  static void gpu_tile_rows_on_x(Stage s, Var c, Var b) {
    Var co("co"), ci("ci"), bo("bo"), bi("bi");
    s.split(c, co, ci, 32, TailStrategy::GuardWithIf)
        .split(b, bo, bi, 8, TailStrategy::GuardWithIf)
        .reorder(ci, bi, bo, co)
        .gpu_threads(ci, bi)
        .gpu_blocks(bo, co);
  }
  void pointwise(Func f) {
    Var co("co"), ci("ci"), bo("bo"), bi("bi");
    if (gpu) {
      gpu_tile_rows_on_x(f.compute_root(), v.c, v.b);
      return;
    }
    f.compute_root()
        .split(v.c, co, ci, vec, TailStrategy::GuardWithIf)
        .vectorize(ci)
        .parallel(v.b, rows_per_task, TailStrategy::GuardWithIf);
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
    const int task_rows = 2 * vec;
    f.compute_root().split(v.b, bo, bi, task_rows, TailStrategy::GuardWithIf).parallel(bo).vectorize(bi, vec);
    if (f.has_update_definition())
      f.update()
          .split(v.b, bo, bi, task_rows, TailStrategy::GuardWithIf)
          .reorder(bi, f.rvars(0)[0], bo)
          .parallel(bo)
          .vectorize(bi, vec);
    for (Func &p : partial) {
      p.compute_at(f, bo).bound_storage(v.b, task_rows).vectorize(v.b, vec, TailStrategy::GuardWithIf);
      p.update().reorder(v.b, p.rvars(0)[0]).vectorize(v.b, vec, TailStrategy::GuardWithIf);
    }
  }
  // A dot product f(s, h, b) over a head's `width` features. CPU: the products accumulate
  // lane-wise, one vector per (position, head) (an rfactor over vector lanes, computed at each
  // position: one vector, whatever the row's length), and the lanes are then added in order. The kernels are
  // strict_float (CMakeLists.txt), so that order is the same wherever the Func is compiled. A width that is no multiple
  // of the vector width (or none given) stays a plain loop. On a GPU the product stays a loop within its thread.
  void dot(Func f, int width = 0) {
    if (gpu || width == 0 || width % vec != 0) return;
    RVar rdo("rdo"), rdi("rdi");
    const Var u("u"), s("s"), h("h");
    Func lanes = f.update().split(f.rvars(0)[0], rdo, rdi, vec).rfactor(rdi, u);
    f.update().reorder(rdi, s, h).unroll(rdi);
    lanes.compute_at(f, s).reorder_storage(u, s, h, v.b).vectorize(u);
    lanes.update().reorder(u, rdo, s).vectorize(u);
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

  // Halide keeps a constant-size buffer on the stack up to 16 KiB, and takes larger ones from the
  // heap (which no kernel may do): buffers a schedule puts on the stack must fit this.
  static bool fits_stack(long long bytes) { return bytes <= 16 * 1024; }
  // A table of `width` columns by row, computed for the rows of each task of `consumer` (scheduled
  // by pointwise: tasks of rows_per_task rows), on the stack.
  void row_table(Func f, Func consumer, int width) {
    f.compute_at(consumer, v.b)
        .bound_storage(v.c, width)
        .bound_storage(v.b, rows_per_task)
        .store_in(Halide::MemoryType::Stack);
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
      // The reductions over classes vectorized across rows: each row still sums its classes in
      // order (the same bits as one row at a time), a vector of rows per class.
      const RVar r = ce.row_max.rvars(0)[0];
      ce.row_max.compute_root().split(v.b, bo, bi, vec, TailStrategy::GuardWithIf).parallel(bo).vectorize(bi);
      ce.row_max.update()
          .split(v.b, bo, bi, vec, TailStrategy::GuardWithIf)
          .reorder(bi, r, bo)
          .parallel(bo)
          .vectorize(bi);
      ce.row_lse.compute_root().split(v.b, bo, bi, vec, TailStrategy::GuardWithIf).parallel(bo).vectorize(bi);
      ce.sum_exp.compute_at(ce.row_lse, bo).vectorize(v.b, vec, TailStrategy::GuardWithIf);
      ce.sum_exp.update().reorder(v.b, ce.sum_exp.rvars(0)[0]).vectorize(v.b, vec, TailStrategy::GuardWithIf);
      for (Func f : {ce.row_loss, ce.row_correct})
        f.compute_root().parallel(v.b, rows_per_task, TailStrategy::GuardWithIf);
    }
    pointwise(ce.dlogits);
  }
  // A flat 1-D elementwise Func (AdamW, parameter copies), in tasks of 1024 vectors.
  void flat(Func upd) {
    Var co("co"), ci("ci");
    if (gpu) {
      upd.compute_root().gpu_tile(v.c, co, ci, 256, TailStrategy::GuardWithIf);
      return;
    }
    upd.compute_root()
        .split(v.c, co, ci, vec * 1024, TailStrategy::GuardWithIf)
        .parallel(co)
        .vectorize(ci, vec, TailStrategy::GuardWithIf);
  }

  const Vars &v;
  int vec;
  bool gpu;
};

}  // namespace remat::gen
