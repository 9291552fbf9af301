// The attention kind's rules for the model compiler (fused q | k | v in, heads of C / H, dropout on
// the probabilities). The forward writes the log-sum-exp per (row, head); backward rebuilds the
// probabilities from it and reads the attention's own output (for delta). CPU kernels run it by
// (sequence, head) tiles where their buffers fit Halide's stack.
#pragma once

#include "kinds/attention/algorithm.h"
#include "kinds/attention/schedule.h"
#include "stage_kernels.h"

#include <optional>
#include <stdexcept>
#include <string>

namespace remat::modelc {

template <>
struct KindRules<Op::attention> {
  static void statistics(StageKernels &k, int j) {
    const LocalTensor lse = stats_of(k.blk, j)[0];
    if (k.saved(lse.key)) k.f.stats[j] = {k.args.read(lse)};
  }

  static Built forward(StageKernels &k, int j, const std::string &name) {
    const Layer &l = k.blk.layers[j];
    const Func qkv = k.value(k.blk.source(j));
    std::optional<Func> saved_lse;
    if (k.f.stats.count(j)) saved_lse = k.f.stats.at(j)[0];
    Func out;
    const auto finish = [&](auto &a) {  // gen::Attention or gen::AttentionTiles
      if (!saved_lse) k.output(k.statistic(j, 0), a.lse);
      k.f.stats[j] = {saved_lse ? *saved_lse : a.lse};
      out = a.out;
    };
    if (!k.sched.gpu && !gen::Scheduler::fits_stack(4LL * k.seq.T))
      throw std::runtime_error("attention over " + std::to_string(k.seq.T) +
                               " positions: the CPU kernels keep a head's row of scores on the stack (16 KiB: at most "
                               "4096 positions)");
    const gen::CausalAttention attention(k.seq);
    gen::AttentionSchedule schedule(k.sched);
    if (tiles(k, l)) {
      gen::AttentionTiles a = attention.attention_tiles(k.layer_name("att", j), qkv, l.out, l.heads, k.dropout_at(j),
                                                        saved_lse, name, l.kv_heads);
      finish(a);
      schedule.tiles(a, !saved_lse, l.out / l.heads, k.seq.T);
    } else {
      gen::Attention a = attention.attention(k.layer_name("att", j), qkv, l.out, l.heads, k.dropout_at(j), saved_lse,
                                             name, l.kv_heads);
      finish(a);
      schedule.forward(a, !saved_lse, l.out / l.heads, k.seq.T);
    }
    return {out, true};
  }

  static void backward(StageKernels &k, int j, Func, Func d) {
    const Layer &l = k.blk.layers[j];
    const int src = k.blk.source(j);
    gen::AttentionGrad g =
        gen::CausalAttention(k.seq).attention_grad(k.layer_name("att", j), k.value(src), k.value(j), k.f.stats.at(j)[0],
                                                   d, l.out, l.heads, k.dropout_at(j), l.kv_heads, !k.sched.gpu);
    gen::AttentionSchedule(k.sched).delta(g.delta);
    k.output(k.workspace(j, 0), g.delta);
    const int head_dim = l.out / l.heads;
    Contribution c{g.dqkv, {}, -1, [&k, g, head_dim](Func consumer) {
                     gen::AttentionSchedule(k.sched).grad(consumer, g, head_dim, k.seq.T);
                   }};
    if (tiles(k, l))
      c.whole = [&k, qkv = k.value(src), lse = k.f.stats.at(j)[0], dout = d, delta = g.delta, drop = k.dropout_at(j),
                 batch = k.batch, j, l, head_dim](const std::string &name) {
        gen::AttentionTilesGrad t = gen::CausalAttention(k.seq).attention_tiles_grad(
            k.layer_name("datt", j), qkv, delta, lse, dout, l.out, l.heads, drop, batch, name, l.kv_heads);
        gen::AttentionSchedule(k.sched).tiles_grad(t, head_dim, k.seq.T);
        return t.dqkv;
      };
    k.add_grad(src, c);
  }

private:
  // CPU attention (forward, and backward where its gradient is the qkv tensor's only one) by
  // (sequence, head) tiles where their buffers fit Halide's stack.
  static bool tiles(const StageKernels &k, const Layer &l) {
    return !k.sched.gpu && gen::AttentionSchedule::tiles_fit(l.out, l.heads, k.seq.T);
  }
};

}  // namespace remat::modelc
