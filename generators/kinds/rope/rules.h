// The rope kind's rules for the model compiler: the rotation of the q and k heads of a fused
// [q | k | v] row; its gradient is the inverse rotation of the output's gradient (backward reads
// neither input nor output).
#pragma once

#include "kinds/rope/algorithm.h"
#include "stage_kernels.h"

#include <optional>
#include <string>

namespace remat::modelc {

template <>
struct KindRules<Op::rope> {
  static Built forward(StageKernels &k, int j, const std::string &name) {
    const Layer &l = k.blk.layers[j];
    const auto table = rope_table(k, j, gen::part(name, "table"));
    Func r = gen::Rope(k.seq, k.blk.layers[j].rope_theta)
                 .rotate(gen::part(name, "rotation"), k.value(k.blk.source(j)), l.heads, l.kv_heads, head_dim(l), false,
                         table ? &*table : nullptr);
    Func y(name);
    y(k.v.c, k.v.b) = k.L.store(r(k.v.c, k.v.b));
    return {y};
  }
  static void backward(StageKernels &k, int j, Func, Func d) {
    const Layer &l = k.blk.layers[j];
    const int src = k.blk.source(j);
    if (!k.flows(src)) return;
    const auto table = rope_table(k, j, k.layer_name("rope", j, "dx_table"));
    k.add_grad(src, {gen::Rope(k.seq, k.blk.layers[j].rope_theta)
                         .rotate(k.layer_name("rope", j, "dx"), d, l.heads, l.kv_heads, head_dim(l), true,
                                 table ? &*table : nullptr)});
  }

private:
  static int head_dim(const Layer &l) { return l.out / (l.heads + 2 * l.kv_heads); }
  // CPU kernels read the rotation's cos and sin from a [D / 2, T] table computed once per call, on
  // the stack where it fits (Halide's limit); GPU kernels compute them per element.
  static std::optional<gen::Rope::Table> rope_table(StageKernels &k, int j, const std::string &name) {
    const int half = head_dim(k.blk.layers[j]) / 2;
    if (k.sched.gpu || !gen::Scheduler::fits_stack(2LL * half * k.seq.T * 4)) return std::nullopt;
    gen::Rope::Table t = gen::Rope(k.seq, k.blk.layers[j].rope_theta).table(name, 2 * half);
    k.sched.table(t.cos, half, k.seq.T);
    k.sched.table(t.sin, half, k.seq.T);
    return t;
  }
};

}  // namespace remat::modelc
