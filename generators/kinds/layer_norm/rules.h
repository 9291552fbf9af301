// The layer_norm kind's rules for the model compiler: its row statistics (mean, rstd) are written
// by the forward and read back by backward kernels where the plan saved them.
#pragma once

#include "kinds/layer_norm/algorithm.h"
#include "stage_kernels.h"

#include <string>
#include <vector>

namespace remat::modelc {

template <>
struct KindRules<Op::layer_norm> {
  static void statistics(StageKernels &k, int j) {
    const std::vector<LocalTensor> st = stats_of(k.blk, j);  // mean, rstd
    if (k.saved(st[0].key)) {
      k.f.stats[j] = {k.args.read(st[0]), k.args.read(st[1])};
      return;
    }
    gen::LayerNorm::Stats s =
        gen::LayerNorm(k.L, k.blk.layers[j].eps)
            .stats(k.name(st[0].key), k.name(st[1].key), k.value(k.blk.source(j)), k.blk.layers[j].in);
    k.sched.row_reduction(s.mean, {s.sum});
    k.sched.row_reduction(s.rstd, {s.sq});
    k.output(st[0].key, s.mean);
    k.output(st[1].key, s.rstd);
    k.f.stats[j] = {s.mean, s.rstd};
  }

  static Built forward(StageKernels &k, int j, const std::string &name) {
    return {gen::LayerNorm(k.L, k.blk.layers[j].eps)
                .forward(name, k.value(k.blk.source(j)), stats(k, j), k.param(j, 0), k.param(j, 1))};
  }

  static void backward(StageKernels &k, int j, Func, Func d) {
    const Layer &l = k.blk.layers[j];
    const int src = k.blk.source(j);
    auto g = gen::LayerNorm(k.L, k.blk.layers[j].eps)
                 .grad(k.name(k.workspace(j, 0)), k.name(k.workspace(j, 1)), k.layer_name("ln", j, "dx"), k.value(src),
                       stats(k, j), k.param(j, 0), d, l.in, k.batch);
    k.write_column_sum_grad(j, 0, g.dgamma, l.in);
    k.write_column_sum_grad(j, 1, g.dbeta, l.in);
    if (!k.flows(src)) return;
    k.sched.row_reduction(g.s1);
    k.sched.row_reduction(g.s2);
    k.output(k.workspace(j, 0), g.s1);
    k.output(k.workspace(j, 1), g.s2);
    k.add_grad(src, {g.dx});
  }

private:
  static gen::LayerNorm::Stats stats(StageKernels &k, int j) { return {k.f.stats.at(j)[0], k.f.stats.at(j)[1]}; }
};

}  // namespace remat::modelc
