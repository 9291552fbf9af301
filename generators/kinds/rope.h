// Rules of the rope kind (rotary position embedding of the q and k heads of a fused [q | k | v]
// row): part of modelc.cpp, included after StageKernels. Its gradient is the inverse rotation of
// the output's gradient: backward reads neither input nor output.
Built rope_forward(StageKernels &k, int j, const std::string &name) {
  const Layer &l = k.blk.layers[j];
  Func r = k.tr.rope(name + "_rotation", k.value(k.blk.source(j)), l.heads, l.kv_heads, l.out / (l.heads + 2 * l.kv_heads));
  Func y(name);
  y(k.v.c, k.v.b) = k.L.store(r(k.v.c, k.v.b));
  return {y};
}
void rope_backward(StageKernels &k, int j, Func, Func d) {
  const Layer &l = k.blk.layers[j];
  const int src = k.blk.source(j);
  if (k.flows(src))
    k.add_grad(src, {k.tr.rope(str(cat("rope", j, "_dx")), d, l.heads, l.kv_heads, l.out / (l.heads + 2 * l.kv_heads), true)});
}
constexpr KindRules rope_rules{Op::rope, nullptr, rope_forward, rope_backward};
