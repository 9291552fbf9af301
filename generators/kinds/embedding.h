// Rules of the embedding kind (token table, and a position table unless positions come from
// rope; token ids in): part of modelc.cpp, included after StageKernels. Always a model's first
// layer: no input gradient.
Built embedding_forward(StageKernels &k, int j, const std::string &name) {
  std::optional<Func> positions;
  if (k.blk.layers[j].bias) positions = k.param(j, "b");
  return {k.tr.embedding(name, k.f.x, k.param(j, "w"), positions, k.blk.layers[j].vocab)};
}

void embedding_backward(StageKernels &k, int j, Func, Func d) {
  const bool positions = k.blk.layers[j].bias;
  const std::string gw_name = k.grad_of(j, "w"), gb_name = positions ? k.grad_of(j, "b") : gw_name + "_positions";
  gen::EmbeddingGrad g = k.tr.embedding_grad(
      str(cat("emb", j)), k.f.x, d, k.blk.layers[j].vocab, k.batch,
      k.accumulated(gw_name, k.L.constant(0), {k.v.c, k.v.b}),
      positions ? k.accumulated(gb_name, k.L.constant(0), {k.v.c, k.v.b}) : k.L.constant(0), gw_name, gb_name);
  k.sched.embedding_grad(g);
  k.output(g.dwte);
  if (positions) k.output(g.dwpe);
}

constexpr KindRules embedding_rules{Op::embedding, nullptr, embedding_forward, embedding_backward};
