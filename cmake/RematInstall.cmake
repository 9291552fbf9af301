# `cmake --install <build> --prefix <prefix>`: remat as a CMake package that other projects use
# with find_package(remat), remat_add_model and remat_add_trainer (cmake/RematModel.cmake):
#   <prefix>/lib/            the libraries (language, tensors, planner, dsl, modelc, runtime, trainer)
#   <prefix>/include/remat/  the headers the modules and the model compiler include
#   <prefix>/lib/cmake/remat/ the package: targets remat::*, their module sources (the importing
#                            project builds their BMIs with its own compiler flags), the functions,
#                            and where remat found Halide and MKL.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
set(REMAT_PACKAGE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/remat)
install(TARGETS remat_language remat_tensors remat_planner remat_dsl remat_layers remat_modelc remat_runtime
                remat_trainer remat_mkl
        EXPORT remat-targets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        FILE_SET CXX_MODULES DESTINATION ${REMAT_PACKAGE_DIR}/modules
        FILE_SET kinds_generated DESTINATION ${REMAT_PACKAGE_DIR}/modules/generated)
install(EXPORT remat-targets NAMESPACE remat:: DESTINATION ${REMAT_PACKAGE_DIR} CXX_MODULES_DIRECTORY modules)
install(DIRECTORY generators/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/remat FILES_MATCHING PATTERN "*.h")
install(FILES runtime/bf16.h runtime/cuda_device.h runtime/gemm.h runtime/launch_limits.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/remat/runtime)
configure_package_config_file(cmake/rematConfig.cmake.in ${CMAKE_BINARY_DIR}/rematConfig.cmake
                              INSTALL_DESTINATION ${REMAT_PACKAGE_DIR})
write_basic_package_version_file(${CMAKE_BINARY_DIR}/rematConfigVersion.cmake VERSION 0.1.0
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/rematConfig.cmake ${CMAKE_BINARY_DIR}/rematConfigVersion.cmake
              cmake/RematModel.cmake cmake/RematMKL.cmake
        DESTINATION ${REMAT_PACKAGE_DIR})
