// The relu2 kind's rules for the model compiler: its output from its input, its input's gradient
// from its input. Both are elementwise: the model compiler's pointwise schedule (CPU, CUDA and
// OpenCL alike) runs them where they are buffered; no schedule hook of its own.
#pragma once

#include "kinds/relu2/algorithm.h"
#include "stage_kernels.h"

#include <string>

namespace remat::modelc {

template <>
struct KindRules<Op::relu2> {
  static Built forward(StageKernels &k, int j, const std::string &name) {
    return {gen::Relu2(k.L).forward(name, k.value(k.blk.source(j)))};
  }
  static void backward(StageKernels &k, int j, Func, Func d) {
    const int src = k.blk.source(j);
    if (k.flows(src)) k.add_grad(src, {gen::Relu2(k.L).grad(k.layer_name("relu2_", j, "dx"), k.value(src), d)});
  }
};

}  // namespace remat::modelc
