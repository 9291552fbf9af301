// The dropout kind's rules for the model compiler: inverted dropout whose mask is a counter hash of
// seed, step, block and element, so a recompute draws it again. It continues a GEMM's epilogue
// chain.
#pragma once

#include "kinds/dropout/algorithm.h"
#include "stage_kernels.h"

#include <string>

namespace remat::modelc {

template <>
struct KindRules<Op::dropout> {
  static Built forward(StageKernels &k, int j, const std::string &name) {
    const gen::Dropout d = k.dropout_at(j);
    return k.chain_link(j, name, [&k, d, w = k.blk.layers[j].out](Expr e) {
      return d.enabled ? e * gen::dropout_factor(k.L, d, gen::activation_element(k.v.c, d.row(k.v.b), w)) : e;
    });
  }
  static void backward(StageKernels &k, int j, Func, Func d) {
    const int src = k.blk.source(j);
    if (k.flows(src))
      k.add_grad(src, {gen::dropout_grad(k.L, k.layer_name("drop", j, "dx"), d, k.blk.layers[j].out, k.dropout_at(j))});
  }
};

}  // namespace remat::modelc
