// The swiglu kind's rules for the model compiler: [a | b] in (2H), silu(a) * b out (H); its
// input's gradient has the input's 2H features.
#pragma once

#include "kinds/swiglu/algorithm.h"
#include "stage_kernels.h"

#include <string>

namespace remat::modelc {

template <>
struct KindRules<Op::swiglu> {
  static Built forward(StageKernels &k, int j, const std::string &name) {
    return {gen::Swiglu(k.L).forward(name, k.value(k.blk.source(j)), k.blk.layers[j].out)};
  }
  static void backward(StageKernels &k, int j, Func, Func d) {
    const int src = k.blk.source(j);
    if (k.flows(src))
      k.add_grad(src, {gen::Swiglu(k.L).grad(k.layer_name("swiglu", j, "dx"), k.value(src), d, k.blk.layers[j].out)});
  }
};

}  // namespace remat::modelc
