// Rules of the rope kind (rotary position embedding of the q and k heads of a fused [q | k | v]
// row): part of modelc.cpp, included after StageKernels. Its gradient is the inverse rotation of
// the output's gradient: backward reads neither input nor output.
int rope_head_dim(const Layer &l) { return l.out / (l.heads + 2 * l.kv_heads); }
// CPU kernels read the rotation's cos and sin from a [D / 2, T] table computed once per call, on
// the stack where it fits (Halide's limit); GPU kernels compute them per element.
std::optional<gen::Transformer::RopeTable> rope_table(StageKernels &k, int j, const std::string &name) {
  const int half = rope_head_dim(k.blk.layers[j]) / 2;
  if (k.sched.gpu || !Scheduler::fits_stack(2LL * half * k.tr.T * 4)) return std::nullopt;
  gen::Transformer::RopeTable t = k.tr.rope_table(name, 2 * half);
  k.sched.table(t.cos, half, k.tr.T);
  k.sched.table(t.sin, half, k.tr.T);
  return t;
}
Built rope_forward(StageKernels &k, int j, const std::string &name) {
  const Layer &l = k.blk.layers[j];
  const auto table = rope_table(k, j, name + "_table");
  Func r = k.tr.rope(name + "_rotation", k.value(k.blk.source(j)), l.heads, l.kv_heads, rope_head_dim(l), false,
                     table ? &*table : nullptr);
  Func y(name);
  y(k.v.c, k.v.b) = k.L.store(r(k.v.c, k.v.b));
  return {y};
}
void rope_backward(StageKernels &k, int j, Func, Func d) {
  const Layer &l = k.blk.layers[j];
  const int src = k.blk.source(j);
  if (!k.flows(src)) return;
  const auto table = rope_table(k, j, str(cat("rope", j, "_dx_table")));
  k.add_grad(src, {k.tr.rope(str(cat("rope", j, "_dx")), d, l.heads, l.kv_heads, rope_head_dim(l), true,
                             table ? &*table : nullptr)});
}
constexpr KindRules rope_rules{Op::rope, nullptr, rope_forward, rope_backward};
