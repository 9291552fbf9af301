// The embedding kind's rules for the model compiler: a token table (and a position table unless
// positions come from rope), token ids in. Always a model's first layer: no input gradient.
#pragma once

#include "kinds/embedding/algorithm.h"
#include "stage_kernels.h"

#include <optional>
#include <string>

namespace remat::modelc {

template <>
struct KindRules<Op::embedding> {
  static Built forward(StageKernels &k, int j, const std::string &name) {
    std::optional<Func> positions;
    if (k.blk.layers[j].bias) positions = k.param(j, 1);
    return {gen::Embedding(k.seq).forward(name, k.f.x, k.param(j, 0), positions, k.blk.layers[j].vocab)};
  }

  static void backward(StageKernels &k, int j, Func, Func d) {
    const bool positions = k.blk.layers[j].bias;
    const TensorKey gw = k.gradient(j, 0), gb = k.gradient(j, 1);
    const std::string gw_name = k.name(gw), gb_name = positions ? k.name(gb) : gen::part(gw_name, "positions");
    gen::Embedding::Grad g = gen::Embedding(k.seq).grad(
        k.layer_name("emb", j), k.f.x, d, k.blk.layers[j].vocab, k.batch,
        k.accumulated(gw, k.L.constant(0), {k.v.c, k.v.b}),
        positions ? k.accumulated(gb, k.L.constant(0), {k.v.c, k.v.b}) : k.L.constant(0), gw_name, gb_name);
    schedule_grad(k.sched, g);
    k.output(gw, g.dwte);
    if (positions) k.output(gb, g.dwpe);
  }

  // The token table is a scatter-add over rows (serial in the rows, so deterministic),
  // vectorized (CPU) or a thread per feature (GPU); the position table sums the sequences of
  // each position.
  static void schedule_grad(gen::Scheduler &s, gen::Embedding::Grad g) {
    using Halide::TailStrategy;
    const gen::Vars &v = s.v;
    Var co("co"), ci("ci"), bo("bo"), bi("bi");
    if (s.gpu) {
      gen::Scheduler::gpu_tile_rows_on_x(g.dwte.compute_root(), v.c, v.b);
      g.dwte.update().gpu_tile(v.c, co, ci, 64, TailStrategy::GuardWithIf);
      gen::Scheduler::gpu_tile_rows_on_x(g.dwpe.compute_root(), v.c, v.b);
      gen::Scheduler::gpu_tile_rows_on_x(g.dwpe.update(), v.c, v.b);
      return;
    }
    g.dwte.compute_root().vectorize(v.c, s.vec, TailStrategy::GuardWithIf);
    g.dwte.update().vectorize(v.c, s.vec, TailStrategy::GuardWithIf);
    g.dwpe.compute_root().vectorize(v.c, s.vec, TailStrategy::GuardWithIf).parallel(v.b);
    g.dwpe.update().vectorize(v.c, s.vec, TailStrategy::GuardWithIf).parallel(v.b);
  }
};

}  // namespace remat::modelc
