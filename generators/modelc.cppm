// module remat.modelc: the model compiler. Run by the build, once per model: it instantiates the
// kinds' Halide algorithms (generators/kinds/<kind>/) for every stage of a model and writes, into
// one folder, the kernel objects, their C headers, a static library and the C++ module interface
// `<model>.kernels` that trainers import. Its definition (generators/modelc.cpp) is a plain
// translation unit, so its declaration belongs to the global module.
module;
#include <string_view>
export module remat.modelc;
import remat.language;

export extern "C++" {
  namespace remat::modelc {
  // Command line: <exe> --out DIR --cpu-target TARGET. Returns the process exit code.
  int main(int argc, char **argv, const Model &model, std::string_view model_name);
  }  // namespace remat::modelc
}
