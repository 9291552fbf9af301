// The test models: every suite runs the models of this one list (tests/CMakeLists.txt, one
// remat_test_model line each, from which CMake generates test_models.h: their imports and entries).
// A new zoo model is one line there. Include after the headers that come before imports.
#pragma once

#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>
import remat;
import remat.runtime;

namespace remat::testing {

struct TestModel {
  std::string_view name;
  const Model &model;
  std::span<const runtime::Kernel> cpu, cuda, opencl;  // kernel tables (opencl: empty unless OPENCL)
  std::vector<int> samples;  // micro-batches the guarantees run at (rows >= 8; one of no tile multiple)
  int gpu_samples;           // the micro-batch of the GPU and PoCL tests
  double dropout;            // the dropout the tests run with (0: the model has none)
  bool example;              // an example's model (its float64 reference is described by hand)
  bool bf16_reference;       // its bf16 kernels compare with the float64 reference (test_model_gradients)
  std::string_view archive;  // its kernel library, lib<name>_kernels.a (CPU objects and CUDA PTX)
};

}  // namespace remat::testing

#include "test_models.h"  // generated: remat::testing::test_models()

namespace remat::testing {

inline const TestModel &test_model(std::string_view name) {
  for (const TestModel &m : test_models())
    if (m.name == name) return m;
  throw std::invalid_argument("no test model " + std::string(name));
}

}  // namespace remat::testing
