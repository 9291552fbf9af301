// The attention kind's schedules. GPU kernels: by rows (forward, gradient and delta). CPU
// kernels: delta only (the attention itself is the runtime's, runtime/attention.cpp).
#pragma once

#include <Halide.h>

#include "kinds/attention/algorithm.h"
#include "schedules.h"

#include <algorithm>

namespace remat::gen {

class AttentionSchedule {
  using Func = Halide::Func;
  using Var = Halide::Var;
  using TailStrategy = Halide::TailStrategy;

public:
  explicit AttentionSchedule(Scheduler &scheduler) : sched(scheduler), v(scheduler.v), gpu(scheduler.gpu) {}

  // Causal attention forward on a GPU: a thread block per (row, head), rows on the grid's x axis
  // (up to 2^31 - 1 blocks; y and z stop at 65,535), heads on y; the row's scores and
  // probabilities for that head sit in shared memory (T floats each), its threads run over key
  // positions, then over the head's features. `lse_computed`: the statistics are computed here
  // (not read from a saved buffer).
  void forward(Attention &a, bool lse_computed, int head_dim, int block_size) {
    Var co("co"), ci("ci"), bo("bo"), bi("bi");
    const Var h("h");
    if (lse_computed) {  // a thread per (row, head) walks the keys
      a.lse.compute_root().reorder(h, v.b).gpu_tile(v.b, bo, bi, 64, TailStrategy::GuardWithIf);
      for (Func f : {a.row_max, a.sum_exp, a.lse_dot}) f.compute_at(a.lse, h);
    }
    a.out.compute_root().split(v.c, co, ci, head_dim).reorder(ci, v.b, co).gpu_blocks(v.b, co).gpu_threads(ci);
    a.sum.compute_at(a.out, ci);  // a thread's own output element, in a register
    // at the innermost block loop (the row): per (row, head)
    for (Func f : {a.dot, a.kept}) positions_in_shared_memory(f, a.out, v.b, block_size);
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
  // The attention input gradient dqkv(c, b) on a GPU, consumed by `consumer` (the tensor's
  // gradient): a block per (row, head of q, k or v), rows on the grid's x axis, as in attention;
  // the chains for that head live in shared memory with threads over positions.
  void grad(Func consumer, AttentionGrad g, int head_dim, int block_size) {
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
  }

private:
  // f(s, h, b), one row's values over key positions s for one head, computed in shared memory at
  // the thread-block loop `at` of `consumer`, threads over positions (vars so, si).
  static void positions_in_shared_memory(Func f, Func consumer, Var at, int block_size) {
    const Var s("s"), so("so"), si("si");
    const int threads = std::min(block_size, 128);
    f.compute_at(consumer, at).split(s, so, si, threads, TailStrategy::GuardWithIf).gpu_threads(si);
    if (f.has_update_definition()) f.update().split(s, so, si, threads, TailStrategy::GuardWithIf).gpu_threads(si);
  }

  Scheduler &sched;
  const Vars &v;
  bool gpu;
};

}  // namespace remat::gen
