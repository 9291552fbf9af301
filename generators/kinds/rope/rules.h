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
    Func r = rope_of(k, j).rotate(gen::part(name, "rotation"), k.value(k.blk.source(j)), l.heads, l.kv_heads,
                                  head_dim(l), false, table ? &*table : nullptr);
    Func y(name);
    y(k.v.c, k.v.b) = k.L.store(r(k.v.c, k.v.b));
    return {y};
  }
  static void backward(StageKernels &k, int j, Func, Func d) {
    const Layer &l = k.blk.layers[j];
    const int src = k.blk.source(j);
    if (!k.flows(src)) return;
    const auto table = rope_table(k, j, k.layer_name("rope", j, "dx_table"));
    k.add_grad(src, {rope_of(k, j).rotate(k.layer_name("rope", j, "dx"), d, l.heads, l.kv_heads, head_dim(l), true,
                                          table ? &*table : nullptr)});
  }

private:
  static gen::Rope rope_of(const StageKernels &k, int j) {
    const Layer &l = k.blk.layers[j];
    const Layer::RopeScaling &s = l.rope_scaling;
    return gen::Rope(k.seq, l.rope_theta,
                     {s.factor, s.low_freq_factor, s.high_freq_factor, double(s.original_context)});
  }
  static int head_dim(const Layer &l) { return l.out / (l.heads + 2 * l.kv_heads); }
  // CPU kernels read the rotation's cos and sin from a [D / 2, T] table computed once per call, on
  // the stack where it fits (Halide's limit); GPU kernels compute them per element.
  static std::optional<gen::Rope::Table> rope_table(StageKernels &k, int j, const std::string &name) {
    const int half = head_dim(k.blk.layers[j]) / 2;
    if (k.sched.gpu || !gen::Scheduler::fits_stack(2LL * half * k.seq.T * 4)) return std::nullopt;
    gen::Rope::Table t = rope_of(k, j).table(name, 2 * half);
    k.sched.table(t.cos, half, k.seq.T);
    k.sched.table(t.sin, half, k.seq.T);
    return t;
  }
};

}  // namespace remat::modelc
