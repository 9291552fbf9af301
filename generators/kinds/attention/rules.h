// The attention kind's rules for the model compiler (fused q | k | v in, heads of C / H, dropout on
// the probabilities). The forward writes the log-sum-exp per (row, head); backward rebuilds the
// probabilities from it and reads the attention's own output (for delta). CPU kernels call the
// runtime's blocked attention (runtime/attention.cpp) as extern stages; GPU kernels run Halide's
// (gen::CausalAttention, by rows).
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
    std::optional<Func> saved_lse;
    if (k.f.stats.count(j)) saved_lse = k.f.stats.at(j)[0];
    if (!k.sched.gpu) {  // the runtime's blocked attention
      const HostAttention host(k, j);
      const Func lse = saved_lse ? *saved_lse : host.lse(gen::part(k.layer_name("att", j), "lse"));
      if (!saved_lse) k.output(k.statistic(j, 0), lse);
      k.f.stats[j] = {lse};
      return {host.out(lse, name), true};
    }
    gen::Attention a = gen::CausalAttention(k.seq).attention(k.layer_name("att", j), k.value(k.blk.source(j)), l.out,
                                                             l.heads, k.dropout_at(j), saved_lse, name, l.kv_heads);
    if (!saved_lse) k.output(k.statistic(j, 0), a.lse);
    k.f.stats[j] = {saved_lse ? *saved_lse : a.lse};
    gen::AttentionSchedule(k.sched).forward(a, !saved_lse, l.out / l.heads, k.seq.T);
    return {a.out, true};
  }

  static void backward(StageKernels &k, int j, Func dout_stored, Func d) {
    const Layer &l = k.blk.layers[j];
    const int src = k.blk.source(j);
    const std::string name = k.layer_name("att", j);
    if (!k.sched.gpu) {  // the runtime's blocked attention: dqkv stored when it is the whole gradient, else fp32
      const Func delta = gen::CausalAttention(k.seq).attention_delta(name, k.value(j), d, l.out, l.heads);
      gen::AttentionSchedule(k.sched).delta(delta);
      k.output(k.workspace(j, 0), delta);
      const HostAttention host(k, j);
      const Func per_head = host.grad_heads(k.f.stats.at(j)[0], dout_stored, delta, gen::part(name, "dqkv_heads"));
      k.output(k.workspace(j, 1), per_head);
      const Func term = host.grad_sum(per_head, gen::part(name, "dqkv"), Float(32));
      if (product_buffer(k.blk, j)) k.output(product_of(k.blk, j).key, term);  // a planned buffer
      Contribution c{term};
      c.whole = [host, per_head](const std::string &whole) {
        return host.grad_sum(per_head, whole, host.k.stored_type());
      };
      k.add_grad(src, c);
      return;
    }
    Func unused(gen::part(name, "dqkv_heads"));  // the CPU's workspace: GPU kernels write zeros
    unused(k.v.c, k.v.b) = 0.f;
    k.sched.pointwise(unused);
    k.output(k.workspace(j, 1), unused);
    gen::AttentionGrad g = gen::CausalAttention(k.seq).attention_grad(
        name, k.value(src), k.value(j), k.f.stats.at(j)[0], d, l.out, l.heads, k.dropout_at(j), l.kv_heads, true);
    gen::AttentionSchedule(k.sched).delta(g.delta);
    k.output(k.workspace(j, 0), g.delta);
    const int head_dim = l.out / l.heads;
    const auto schedule = [&k, g, head_dim](Func consumer) {
      gen::AttentionSchedule(k.sched).grad(consumer, g, head_dim, k.seq.T);
    };
    if (!product_buffer(k.blk, j)) return k.add_grad(src, Contribution{g.dqkv, {}, -1, schedule});
    Func term(gen::part(name, "dqkv"));  // into its planned buffer, as the CPU's
    term(k.v.c, k.v.b) = g.dqkv(k.v.c, k.v.b);
    schedule(term);
    k.output(product_of(k.blk, j).key, term);
    k.add_grad(src, Contribution{term});
  }

private:
  // The CPU kernels' attention: extern stages calling runtime/attention.cpp on the stored qkv
  // (its whole rows: the planner materializes an attention's input), computed at the root.
  struct HostAttention {
    StageKernels &k;
    Func qkv;
    std::vector<Halide::ExternFuncArgument> shape, dropout;
    HostAttention(StageKernels &kernels, int j) : k(kernels), qkv(k.stored(k.blk.source(j))) {
      const Layer &l = k.blk.layers[j];
      shape = {Expr(k.seq.T), Expr(l.heads), Expr(l.kv_heads), Expr(l.out / l.heads)};
      const gen::Dropout drop = k.dropout_at(j);
      if (!drop.enabled) {
        dropout = {Expr(0), Expr(uint64_t(0)), Expr(0), Expr(0), Expr(uint64_t(0)), Expr(1.f), Expr(0)};
        return;
      }
      const auto u64 = [](Expr e) { return Halide::cast(Halide::UInt(64), e); };
      const auto i32 = [](Expr e) { return Halide::cast(Halide::Int(32), e); };
      dropout = {Expr(1),
                 u64(drop.seed),
                 i32(drop.step),
                 i32(drop.block),
                 u64(drop.threshold),
                 Halide::cast(Halide::Float(32), drop.scale),
                 drop.first_row.defined() ? i32(drop.first_row) : Expr(0)};
    }
    Func call(const std::string &function, std::vector<Halide::ExternFuncArgument> args, bool with_dropout,
              const std::string &name, Halide::Type type, std::vector<Halide::Var> vars) const {
      args.insert(args.end(), shape.begin(), shape.end());
      if (with_dropout) args.insert(args.end(), dropout.begin(), dropout.end());
      Func f(name);
      f.define_extern(function, args, type, vars, Halide::NameMangling::C);
      f.compute_root();
      return f;
    }
    // lse(h, b)
    Func lse(const std::string &name) const {
      return call("remat_attention_lse", {qkv}, false, name, Float(32), {Halide::Var("h"), k.v.b});
    }
    // out(c, b), stored
    Func out(Func lse, const std::string &name) const {
      return call("remat_attention_out", {qkv, lse}, true, name, k.stored_type(), {k.v.c, k.v.b});
    }
    // per_head(c, b): each query head's dq, dk, dv in fp32 (runtime/attention.h)
    Func grad_heads(Func lse, Func dout, Func delta, const std::string &name) const {
      return call("remat_attention_grad", {qkv, lse, dout, delta}, true, name, Float(32), {k.v.c, k.v.b});
    }
    // dqkv(c, b) from per_head: stored, or fp32 when one term of the tensor's gradient
    Func grad_sum(Func per_head, const std::string &name, Halide::Type type) const {
      return call("remat_attention_grad_sum", {per_head}, false, name, type, {k.v.c, k.v.b});
    }
  };
};

}  // namespace remat::modelc
