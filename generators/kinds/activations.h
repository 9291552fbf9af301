// Rules of the elementwise activation kinds (gelu, relu): part of modelc.cpp, included after
// StageKernels. Their backward reads their input.
Built gelu_forward(StageKernels &k, int j, const std::string &name) {
  return {k.L.gelu(name, k.value(k.blk.source(j)))};
}
void gelu_backward(StageKernels &k, int j, Func, Func d) {
  const int src = k.blk.source(j);
  if (k.flows(src)) k.add_grad(src, {k.L.gelu_grad(str(cat("gelu", j, "_dx")), k.value(src), d)});
}
constexpr KindRules gelu_rules{Op::gelu, nullptr, gelu_forward, gelu_backward};

Built relu_forward(StageKernels &k, int j, const std::string &name) {
  return {k.L.relu(name, k.value(k.blk.source(j)))};
}
void relu_backward(StageKernels &k, int j, Func, Func d) {
  const int src = k.blk.source(j);
  if (k.flows(src)) k.add_grad(src, {k.L.relu_grad(str(cat("relu", j, "_dx")), k.value(src), d)});
}
constexpr KindRules relu_rules{Op::relu, nullptr, relu_forward, relu_backward};

// swiglu: [a | b] in (2H), silu(a) * b out (H); its gradient has the input's 2H features.
Built swiglu_forward(StageKernels &k, int j, const std::string &name) {
  return {k.L.swiglu(name, k.value(k.blk.source(j)), k.blk.layers[j].out)};
}
void swiglu_backward(StageKernels &k, int j, Func, Func d) {
  const int src = k.blk.source(j);
  if (k.flows(src))
    k.add_grad(src, {k.L.swiglu_grad(str(cat("swiglu", j, "_dx")), k.value(src), d, k.blk.layers[j].out)});
}
constexpr KindRules swiglu_rules{Op::swiglu, nullptr, swiglu_forward, swiglu_backward};
