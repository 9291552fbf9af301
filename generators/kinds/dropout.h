// Rules of the dropout kind (inverted dropout; the mask a counter hash of seed, step, block and
// element, so a recompute draws it again): part of modelc.cpp, included after StageKernels. It
// continues a GEMM's epilogue chain.
Built dropout_forward(StageKernels &k, int j, const std::string &name) {
  const gen::Dropout d = k.dropout_at(j);
  return k.chain_link(j, name, [&k, d, w = k.blk.layers[j].out](Expr e) {
    return d.enabled ? e * k.tr.dropout_factor(d, k.tr.activation_element(k.v.c, k.v.b, w)) : e;
  });
}
void dropout_backward(StageKernels &k, int j, Func, Func d) {
  const int src = k.blk.source(j);
  if (k.flows(src))
    k.add_grad(src, {k.tr.dropout_grad(str(cat("drop", j, "_dx")), d, k.blk.layers[j].out, k.dropout_at(j))});
}
constexpr KindRules dropout_rules{Op::dropout, nullptr, dropout_forward, dropout_backward};
