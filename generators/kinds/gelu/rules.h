// The gelu kind's rules for the model compiler: its output from its input, its input's gradient
// from its input (the kind reads its input in backward).
#pragma once

#include "kinds/gelu/algorithm.h"
#include "stage_kernels.h"

#include <string>

namespace remat::modelc {

template <>
struct KindRules<Op::gelu> {
  static Built forward(StageKernels &k, int j, const std::string &name) {
    return {gen::Gelu(k.L, k.blk.layers[j].gelu_exact).forward(name, k.value(k.blk.source(j)))};
  }
  static void backward(StageKernels &k, int j, Func, Func d) {
    const int src = k.blk.source(j);
    if (k.flows(src))
      k.add_grad(src,
                 {gen::Gelu(k.L, k.blk.layers[j].gelu_exact).grad(k.layer_name("gelu", j, "dx"), k.value(src), d)});
  }
};

}  // namespace remat::modelc
