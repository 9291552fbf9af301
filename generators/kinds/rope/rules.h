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
    const bool table = with_table(k, j) && k.writes_output(j);  // then `rotated` schedules it
    return {rotated(k, j, name, k.value(k.blk.source(j)), false, table), table};
  }
  static void backward(StageKernels &k, int j, Func, Func d) {
    const int src = k.blk.source(j);
    if (!k.flows(src)) return;
    const Layer &l = k.blk.layers[j];
    Contribution c{rope_of(k, j).rotate(k.layer_name("rope", j, "dx"), d, l.heads, l.kv_heads, head_dim(l), true)};
    if (with_table(k, j))  // the whole gradient of its source: written by tasks of rows, each with its table
      c.whole = [&k, j, d](const std::string &whole) { return rotated(k, j, whole, d, true, true); };
    k.add_grad(src, c);
  }

private:
  static gen::Rope rope_of(const StageKernels &k, int j) {
    const Layer &l = k.blk.layers[j];
    const Layer::RopeScaling &s = l.rope_scaling;
    return gen::Rope(k.seq, l.rope_theta,
                     {s.factor, s.low_freq_factor, s.high_freq_factor, double(s.original_context)});
  }
  static int head_dim(const Layer &l) { return l.out / (l.heads + 2 * l.kv_heads); }
  // CPU kernels read the rotation's cos and sin from a table of the rows of each task that writes
  // the rotated tensor, on the stack (evaluated once a row and feature pair, not once a head); GPU
  // kernels, and a rotation left inline in its readers, compute them per element.
  static bool with_table(const StageKernels &k, int j) {
    const int half = head_dim(k.blk.layers[j]) / 2;
    return !k.sched.gpu && gen::Scheduler::fits_stack(2LL * half * gen::Scheduler::rows_per_task * 4);
  }
  // x rotated (the inverse rotation for a gradient), as stored; with a table, written by its own
  // tasks (pointwise) reading it.
  static Func rotated(StageKernels &k, int j, const std::string &name, Func x, bool inverse, bool table) {
    const Layer &l = k.blk.layers[j];
    const gen::Rope rope = rope_of(k, j);
    std::optional<gen::Rope::Table> t;
    if (table) t = rope.table(gen::part(name, "table"), head_dim(l));
    Func r = rope.rotate(gen::part(name, "rotation"), x, l.heads, l.kv_heads, head_dim(l), inverse, t ? &*t : nullptr);
    Func y(name);
    y(k.v.c, k.v.b) = k.L.store(r(k.v.c, k.v.b));
    if (t) {
      k.sched.pointwise(y);
      k.sched.row_table(t->cos, y, head_dim(l) / 2);
      k.sched.row_table(t->sin, y, head_dim(l) / 2);
    }
    return y;
  }
};

}  // namespace remat::modelc
