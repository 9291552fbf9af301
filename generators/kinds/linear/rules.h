// The linear kind's rules for the model compiler (y = x w + b, or x w without bias). Library GEMMs
// (MKL, cuBLASLt) are extern stages on buffers; Halide GEMMs (the CPU's bf16 kernels) fuse a
// following dropout / residual chain into their epilogue.
#pragma once

#include "kinds/linear/algorithm.h"
#include "stage_kernels.h"

#include <optional>
#include <stdexcept>
#include <string>

namespace remat::modelc {

template <>
struct KindRules<Op::linear> {
  static Built forward(StageKernels &k, int j, const std::string &name) {
    const Layer &l = k.blk.layers[j];
    const int src = k.blk.source(j);
    if (k.gemms == Gemms::library) {
      if (!k.buffered(src))
        throw std::runtime_error("library GEMM: the input of linear " + std::to_string(j) + " is not a buffer");
      // a tied weight is its target's token table [O, K]: x w = x table^T
      return {k.library_gemm(name, k.stored(src), l.in, false, k.gemm_weight(j), l.tied() ? l.in : l.out, l.tied(),
                             k.library_bias(j), l.in, Expr(0), k.stored_type()),
              true};
    }
    std::optional<Func> bias;
    if (l.bias) bias = k.param(j, 1);
    PendingGemm p{k.value(src), widened(k.gemm_weight(j)), bias, l.in, {}, k.buffered(src)};
    if (fused(k.blk, j)) {
      k.f.pending[j] = p;
      return {.pending = true};
    }
    return {k.build_gemm(name, p, l.out), true};
  }

  // dW = x^T dy (+ dW when accumulating), db a column sum, and the input gradient dy w^T
  static void backward(StageKernels &k, int j, Func d_stored, Func d) {
    const Layer &l = k.blk.layers[j];
    const int src = k.blk.source(j);
    const TensorKey gw_key = k.gradient(j, 0);
    const std::string gw_name = k.name(gw_key);
    if (k.gemms == Gemms::library) {
      // a tied weight's gradient in its target's layout [O, K]: dy^T x
      Func gw = l.tied() ? k.library_gemm(gw_name, d_stored, l.out, true, k.stored(src), l.in, false, std::nullopt,
                                          k.batch, k.args.scalar(Scalar::accumulate), Float(32))
                         : k.library_gemm(gw_name, k.stored(src), l.in, true, d_stored, l.out, false, std::nullopt,
                                          k.batch, k.args.scalar(Scalar::accumulate), Float(32));
      k.output(gw_key, gw);
    } else {
      if (l.tied()) throw std::runtime_error("a tied linear needs library GEMMs");
      MatMul gw = gen::linear_weight_grad(k.L, gw_name, k.value(src), d, k.batch,
                                          [&](Expr sum) { return k.accumulated(gw_key, sum, {k.v.c, k.v.b}); });
      k.sched.matmul(gw, l.in, l.out);
      k.output(gw_key, gw.out);
    }
    if (l.bias)
      k.write_column_sum_grad(j, 1, k.L.column_sum(gen::part(k.name(k.gradient(j, 1)), "sum"), d, k.batch), l.out);
    if (!k.flows(src)) return;
    if (k.gemms == Gemms::library) {  // the library transposes the weight itself
      k.add_grad(src, {Func(), std::pair{d_stored, k.gemm_weight(j)}, j, {}});
    } else {
      const TensorKey wt_key = key::weight_transposed(k.blk, j);
      Func wt = k.L.transpose(k.name(wt_key), k.param(j, 0));
      k.sched.transpose(wt);
      k.output(wt_key, wt);
      k.add_grad(src, {Func(), std::pair{d, widened(wt)}, j, {}});
    }
  }
};

}  // namespace remat::modelc
