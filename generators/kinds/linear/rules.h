// The linear kind's rules for the model compiler (y = x w + b, or x w without bias): GEMMs in a
// library (MKL, cuBLASLt), extern stages on buffers, the bias their only epilogue.
#pragma once

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
    if (!k.buffered(src))
      throw std::runtime_error("GEMM: the input of linear " + std::to_string(j) + " is not a buffer");
    // a tied weight is its target's token table [O, K]: x w = x table^T
    return {k.library_gemm(name, k.stored(src), l.in, false, k.gemm_weight(j), l.tied() ? l.in : l.out, l.tied(),
                           k.gemm_bias(j), l.in, Expr(0), k.stored_type()),
            true};
  }

  // dW = x^T dy (+ dW when accumulating), db a column sum, and the input gradient dy w^T
  static void backward(StageKernels &k, int j, Func d_stored, Func d) {
    const Layer &l = k.blk.layers[j];
    const int src = k.blk.source(j);
    const TensorKey gw_key = k.gradient(j, 0);
    const std::string gw_name = k.name(gw_key);
    // a tied weight's gradient in its target's layout [O, K]: dy^T x
    Func gw = l.tied() ? k.library_gemm(gw_name, d_stored, l.out, true, k.stored(src), l.in, false, std::nullopt,
                                        k.batch, k.adds_to(gw_key), Float(32))
                       : k.library_gemm(gw_name, k.stored(src), l.in, true, d_stored, l.out, false, std::nullopt,
                                        k.batch, k.adds_to(gw_key), Float(32));
    k.output(gw_key, gw);
    if (l.bias)
      k.write_column_sum_grad(j, 1, k.L.column_sum(gen::part(k.name(k.gradient(j, 1)), "sum"), d, k.batch), l.out);
    if (!k.flows(src)) return;
    k.add_grad(src, {Func(), std::pair{d_stored, k.gemm_weight(j)}, j, {}});  // the library transposes w
  }
};

}  // namespace remat::modelc
