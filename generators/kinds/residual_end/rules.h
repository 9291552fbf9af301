// The residual_end kind's rules for the model compiler: the residual sum adds the skip (the
// source of the matching residual( marker) to the branch and continues a GEMM's epilogue chain;
// its gradient flows to both.
#pragma once

#include "stage_kernels.h"

#include <string>

namespace remat::modelc {

template <>
struct KindRules<Op::residual_end> {
  static Built forward(StageKernels &k, int j, const std::string &name) {
    Func skip = k.value(k.blk.skip_source(j));
    return k.chain_link(j, name, [&k, skip](Expr e) { return e + skip(k.v.c, k.v.b); });
  }
  static void backward(StageKernels &k, int j, Func, Func d) {
    k.add_grad(k.blk.source(j), {d});
    k.add_grad(k.blk.skip_source(j), {d});
  }
};

}  // namespace remat::modelc
