// The rms_norm kind's rules for the model compiler: its row statistic rstd is written by the
// forward and read back by backward kernels where the plan saved it.
#pragma once

#include "kinds/rms_norm/algorithm.h"
#include "stage_kernels.h"

#include <string>

namespace remat::modelc {

template <>
struct KindRules<Op::rms_norm> {
  static void statistics(StageKernels &k, int j) {
    const LocalTensor rstd = stats_of(k.blk, j)[0];
    if (k.saved(rstd.key)) {
      k.f.stats[j] = {k.args.read(rstd)};
      return;
    }
    gen::RmsNorm::Stats s =
        gen::RmsNorm(k.L, k.blk.layers[j].eps).stats(k.name(rstd.key), k.value(k.blk.source(j)), k.blk.layers[j].in);
    k.sched.row_reduction(s.rstd, {s.sq});
    k.output(rstd.key, s.rstd);
    k.f.stats[j] = {s.rstd};
  }

  static Built forward(StageKernels &k, int j, const std::string &name) {
    return {gen::RmsNorm(k.L, k.blk.layers[j].eps)
                .forward(name, k.value(k.blk.source(j)), k.f.stats.at(j)[0], k.param(j, 0))};
  }

  static void backward(StageKernels &k, int j, Func, Func d) {
    const Layer &l = k.blk.layers[j];
    const int src = k.blk.source(j);
    auto g = gen::RmsNorm(k.L, k.blk.layers[j].eps)
                 .grad(k.name(k.workspace(j, 0)), k.layer_name("rms", j, "dx"), k.value(src), k.f.stats.at(j)[0],
                       k.param(j, 0), d, l.in, k.batch);
    k.write_column_sum_grad(j, 0, g.dgamma, l.in);
    if (!k.flows(src)) return;
    k.sched.row_reduction(g.s);
    k.output(k.workspace(j, 0), g.s);
    k.add_grad(src, {g.dx});
  }
};

}  // namespace remat::modelc
