// Rules of the rms_norm kind (Llama's RMSNorm over the C features of each row, a gain, no bias):
// part of modelc.cpp, included after StageKernels. Its row statistic rstd is written by the
// forward and read back by backward kernels where the plan saved it.
void rms_norm_statistics(StageKernels &k, int j) {
  const LocalTensor rstd = stats_of(k.blk, j)[0];
  if (k.saved(rstd.name)) {
    k.f.stats[j] = {k.args.read(rstd)};
    return;
  }
  Layers::RmsNormStats s = k.L.rms_norm_stats(str(rstd.name), k.value(k.blk.source(j)), k.blk.layers[j].in);
  k.sched.row_reduction(s.rstd, {s.sq});
  k.output(s.rstd);
  k.f.stats[j] = {s.rstd};
}

Built rms_norm_forward(StageKernels &k, int j, const std::string &name) {
  return {k.L.rms_norm(name, k.value(k.blk.source(j)), k.f.stats.at(j)[0], k.param(j, "w"))};
}

void rms_norm_backward(StageKernels &k, int j, Func, Func d) {
  const Layer &l = k.blk.layers[j];
  const int src = k.blk.source(j);
  auto g = k.L.rms_norm_grad(str(cat("s", j, "_1")), str(cat("rms", j, "_dx")), k.value(src), k.f.stats.at(j)[0],
                             k.param(j, "w"), d, l.in, k.batch);
  k.write_column_sum_grad(j, "w", g.dgamma, l.in);
  if (!k.flows(src)) return;
  k.sched.row_reduction(g.s);
  k.output(g.s);
  k.add_grad(src, {g.dx});
}

constexpr KindRules rms_norm_rules{Op::rms_norm, rms_norm_statistics, rms_norm_forward, rms_norm_backward};
