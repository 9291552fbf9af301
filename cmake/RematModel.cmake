# remat_add_model(<name> MODULE <file.cppm>)
#
# <file.cppm> declares `export module <name>;` with `<name>::model` (a checked remat::Model) and
# `<name>::policy` (its default checkpoint policy), importing remat.language only (what the
# kernels depend on: facts about plans belong in the trainer, which imports remat). This builds the model compiler for it, runs it
# at build time and yields the library <name>_kernels, whose C++ module `<name>.kernels` exports
# the kernel tables (`table` for the CPU, `cuda_table` for CUDA); trainers link it and `import <name>.kernels;`.
# OPENCL: also generate the GPU schedules for OpenCL (table `opencl_table`), for the tests that
# run them on PoCL.
function(remat_add_model name)
  cmake_parse_arguments(ARG "OPENCL" "MODULE" "" ${ARGN})
  set(opencl_flag "")
  if(ARG_OPENCL)
    set(opencl_flag "--opencl")
  endif()
  add_library(${name}_model STATIC)
  target_sources(${name}_model PUBLIC FILE_SET CXX_MODULES FILES ${ARG_MODULE})
  target_link_libraries(${name}_model PUBLIC remat_language)

  set(main ${CMAKE_CURRENT_BINARY_DIR}/${name}_modelc_main.cpp)
  file(CONFIGURE OUTPUT ${main} CONTENT
"import remat.modelc;
import ${name};
int main(int argc, char **argv) { return remat::modelc::main(argc, argv, ${name}::model, \"${name}\"); }
")
  add_executable(${name}-modelc ${main})
  target_link_libraries(${name}-modelc PRIVATE remat_modelc ${name}_model)
  set_target_properties(${name}-modelc PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})

  set(dir ${CMAKE_CURRENT_BINARY_DIR}/kernels)
  add_custom_command(
    OUTPUT ${dir}/lib${name}_kernels.a ${dir}/${name}.kernels.cppm
    COMMAND ${name}-modelc --out ${dir} --cpu-targets ${REMAT_CPU_TARGETS} --cuda-capability ${REMAT_CUDA_CAPABILITY} ${opencl_flag}
    DEPENDS ${name}-modelc
    COMMENT "Generating Halide kernels for model ${name} (${REMAT_CPU_TARGETS}; CUDA sm_${REMAT_CUDA_CAPABILITY} ${opencl_flag})")
  add_custom_target(${name}_kernels_generated DEPENDS ${dir}/lib${name}_kernels.a ${dir}/${name}.kernels.cppm)

  add_library(${name}_kernels STATIC)
  add_dependencies(${name}_kernels ${name}_kernels_generated)
  target_sources(${name}_kernels PUBLIC FILE_SET CXX_MODULES BASE_DIRS ${dir} FILES ${dir}/${name}.kernels.cppm)
  target_include_directories(${name}_kernels PUBLIC ${dir})
  # The generated archive calls into the runtime (the library-GEMM extern stages): it is an
  # imported library that links the runtime after itself.
  add_library(${name}_halide_kernels STATIC IMPORTED)
  set_target_properties(${name}_halide_kernels PROPERTIES IMPORTED_LOCATION ${dir}/lib${name}_kernels.a
                                                          INTERFACE_LINK_LIBRARIES remat_runtime)
  target_link_libraries(${name}_kernels PUBLIC remat_runtime ${name}_model ${name}_halide_kernels)
endfunction()
