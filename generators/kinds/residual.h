// Rules of the residual markers: part of modelc.cpp, included after StageKernels. residual(
// produces nothing (StageKernels passes its source on); the residual sum adds the skip to the
// branch and continues a GEMM's epilogue chain.
Built residual_sum_forward(StageKernels &k, int j, const std::string &name) {
  Func skip = k.value(k.blk.skip_source(j));
  return k.chain_link(j, name, [&k, skip](Expr e) { return e + skip(k.v.c, k.v.b); });
}
void residual_sum_backward(StageKernels &k, int j, Func, Func d) {
  k.add_grad(k.blk.source(j), {d});
  k.add_grad(k.blk.skip_source(j), {d});
}
constexpr KindRules residual_begin_rules{Op::residual_begin};
constexpr KindRules residual_end_rules{Op::residual_end, nullptr, residual_sum_forward, residual_sum_backward};
