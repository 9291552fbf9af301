// Rules of the layer_norm kind (over the C features of each row, gain and bias): part of
// modelc.cpp, included after StageKernels. Its row statistics (mean, rstd) are written by the
// forward and read back by backward kernels where the plan saved them.
void layer_norm_statistics(StageKernels &k, int j) {
  const std::vector<LocalTensor> st = stats_of(k.blk, j);  // mean, rstd
  if (k.saved(st[0].name)) {
    k.f.stats[j] = {k.args.read(st[0]), k.args.read(st[1])};
    return;
  }
  Layers::LayerNormStats s =
      k.L.layer_norm_stats(str(st[0].name), str(st[1].name), k.value(k.blk.source(j)), k.blk.layers[j].in);
  k.sched.row_reduction(s.mean, {s.sum});
  k.sched.row_reduction(s.rstd, {s.sq});
  k.output(s.mean);
  k.output(s.rstd);
  k.f.stats[j] = {s.mean, s.rstd};
}
Layers::LayerNormStats layer_norm_stats(StageKernels &k, int j) { return {k.f.stats.at(j)[0], k.f.stats.at(j)[1]}; }

Built layer_norm_forward(StageKernels &k, int j, const std::string &name) {
  return {k.L.layer_norm(name, k.value(k.blk.source(j)), layer_norm_stats(k, j), k.param(j, "w"), k.param(j, "b"))};
}

void layer_norm_backward(StageKernels &k, int j, Func, Func d) {
  const Layer &l = k.blk.layers[j];
  const int src = k.blk.source(j);
  auto g = k.L.layer_norm_grad(str(cat("s", j, "_1")), str(cat("s", j, "_2")), str(cat("ln", j, "_dx")), k.value(src),
                               layer_norm_stats(k, j), k.param(j, "w"), d, l.in, k.batch);
  k.write_column_sum_grad(j, "w", g.dgamma, l.in);
  k.write_column_sum_grad(j, "b", g.dbeta, l.in);
  if (!k.flows(src)) return;
  k.sched.row_reduction(g.s1);
  k.sched.row_reduction(g.s2);
  k.output(g.s1);
  k.output(g.s2);
  k.add_grad(src, {g.dx});
}

constexpr KindRules layer_norm_rules{Op::layer_norm, layer_norm_statistics, layer_norm_forward, layer_norm_backward};
