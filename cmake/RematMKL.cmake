# MKL's static libraries (sequential, LP64) as imported targets mkl_intel_lp64, mkl_sequential and
# mkl_core, from REMAT_MKL_ROOT (lib/): for remat's own build and for the projects that use an
# installed remat (whose package records where remat found them).
foreach(part intel_lp64 sequential core)
  if(NOT TARGET mkl_${part})
    find_library(REMAT_MKL_${part} libmkl_${part}.a HINTS ${REMAT_MKL_ROOT}/lib NO_DEFAULT_PATH)
    if(NOT REMAT_MKL_${part})
      message(FATAL_ERROR "remat: MKL's libmkl_${part}.a is not in ${REMAT_MKL_ROOT}/lib "
                          "(pip install mkl-static there, or set REMAT_MKL_ROOT)")
    endif()
    add_library(mkl_${part} STATIC IMPORTED)
    set_target_properties(mkl_${part} PROPERTIES IMPORTED_LOCATION ${REMAT_MKL_${part}})
  endif()
endforeach()
