// Rules of the linear kind (y = x w + b, or x w without bias): part of modelc.cpp, included
// after StageKernels. Library GEMMs (MKL, cuBLASLt) are extern stages on buffers; Halide GEMMs
// (the CPU's bf16 kernels) fuse a following dropout / residual chain into their epilogue.
Built linear_forward(StageKernels &k, int j, const std::string &name) {
  const Layer &l = k.blk.layers[j];
  const int src = k.blk.source(j);
  if (k.gemms == Gemms::library) {
    if (!k.buffered(src))
      throw std::runtime_error("library GEMM: the input of linear " + std::to_string(j) + " is not a buffer");
    return {k.library_gemm(name, k.stored(src), l.in, false, k.gemm_weight(j), l.out, false, k.library_bias(j), l.in,
                           Expr(0), k.stored_type()),
            true};
  }
  std::optional<Func> bias;
  if (l.bias) bias = k.param(j, "b");
  PendingGemm p{k.value(src), widened(k.gemm_weight(j)), bias, l.in, {}, k.buffered(src)};
  if (fused(k.blk, j)) {
    k.f.pending[j] = p;
    return {.pending = true};
  }
  return {k.build_gemm(name, p, l.out), true};
}

// dW = x^T dy (+ dW when accumulating), db a column sum, and the input gradient dy w^T
void linear_backward(StageKernels &k, int j, Func d_stored, Func d) {
  const Layer &l = k.blk.layers[j];
  const int src = k.blk.source(j);
  const std::string gw_name = k.grad_of(j, "w");
  if (k.gemms == Gemms::library) {
    Func gw = k.library_gemm(gw_name, k.stored(src), l.in, true, d_stored, l.out, false, std::nullopt, k.batch,
                             k.args.scalar(Scalar::accumulate), Float(32));
    k.output(gw);
  } else {
    MatMul gw = k.L.linear_weight_grad(gw_name, k.value(src), d, k.batch,
                                       [&](Expr sum) { return k.accumulated(gw_name, sum, {k.v.c, k.v.b}); });
    k.sched.matmul(gw, l.in, l.out);
    k.output(gw.out);
  }
  if (l.bias) k.write_column_sum_grad(j, "b", k.L.column_sum(k.grad_of(j, "b") + "_sum", d, k.batch), l.out);
  if (!k.flows(src)) return;
  if (k.gemms == Gemms::library) {  // the library transposes the weight itself
    k.add_grad(src, {Func(), std::pair{d_stored, k.gemm_weight(j)}, j, {}});
  } else {
    Func wt = k.L.transpose(str(cat("p", j, "_wt")), k.param(j, "w"));
    k.sched.transpose(wt);
    k.output(wt);
    k.add_grad(src, {Func(), std::pair{d, widened(wt)}, j, {}});
  }
}

constexpr KindRules linear_rules{Op::linear, nullptr, linear_forward, linear_backward};
