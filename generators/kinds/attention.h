// Rules of the causal self-attention kind (fused q | k | v in, heads of C / H, dropout on the
// probabilities): part of modelc.cpp, included after StageKernels. The forward writes the
// log-sum-exp per (row, head); backward rebuilds the probabilities from it and reads the
// attention's own output (for delta). CPU kernels run it by (sequence, head) tiles where their
// buffers fit Halide's stack.
void attention_statistics(StageKernels &k, int j) {
  const LocalTensor lse = stats_of(k.blk, j)[0];
  if (k.saved(lse.name)) k.f.stats[j] = {k.args.read(lse)};
}

Built attention_forward(StageKernels &k, int j, const std::string &name) {
  const Layer &l = k.blk.layers[j];
  const Func qkv = k.value(k.blk.source(j));
  std::optional<Func> saved_lse;
  if (k.f.stats.count(j)) saved_lse = k.f.stats.at(j)[0];
  Func out;
  const auto finish = [&](auto &a) {  // gen::Attention or gen::AttentionTiles
    if (!saved_lse) k.output(a.lse);
    k.f.stats[j] = {saved_lse ? *saved_lse : a.lse};
    out = a.out;
  };
  if (k.attention_tiles(l)) {
    gen::AttentionTiles a =
        k.tr.attention_tiles(str(cat("att", j)), qkv, l.out, l.heads, k.dropout_at(j), saved_lse, name, l.kv_heads);
    finish(a);
    k.sched.attention_tiles(a, !saved_lse, l.out / l.heads, k.tr.T);
  } else {
    gen::Attention a =
        k.tr.attention(str(cat("att", j)), qkv, l.out, l.heads, k.dropout_at(j), saved_lse, name, l.kv_heads);
    finish(a);
    k.sched.attention(a, !saved_lse, l.out / l.heads, k.tr.T);
  }
  return {out, true};
}

void attention_backward(StageKernels &k, int j, Func, Func d) {
  const Layer &l = k.blk.layers[j];
  const int src = k.blk.source(j);
  gen::AttentionGrad g = k.tr.attention_grad(str(cat("att", j)), k.value(src), k.value(j), k.f.stats.at(j)[0], d, l.out,
                                             l.heads, k.dropout_at(j), l.kv_heads);
  k.sched.attention_delta(g.delta);
  k.output(g.delta);
  const int head_dim = l.out / l.heads;
  Contribution c{
      g.dqkv, {}, -1, [&k, g, head_dim](Func consumer) { k.sched.attention_grad(consumer, g, head_dim, k.tr.T); }};
  if (k.attention_tiles(l))
    c.whole = [&k, qkv = k.value(src), lse = k.f.stats.at(j)[0], dout = d, delta = g.delta, drop = k.dropout_at(j),
               batch = k.batch, j, l, head_dim](const std::string &name) {
      gen::AttentionTilesGrad t = k.tr.attention_tiles_grad(str(cat("datt", j)), qkv, delta, lse, dout, l.out, l.heads,
                                                            drop, batch, name, l.kv_heads);
      k.sched.attention_tiles_grad(t, head_dim, k.tr.T);
      return t.dqkv;
    };
  k.add_grad(src, c);
}

constexpr KindRules attention_rules{Op::attention, attention_statistics, attention_forward, attention_backward};
