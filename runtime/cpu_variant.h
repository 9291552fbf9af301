// Which code the CPU work runs: REMAT_CPU_VARIANT=avx2 makes the CPU kernels (executor.cpp), the
// bf16 dot product (dot_bf16.cpp) and the attention's exp (attention.cpp) run their AVX2 code, as
// on a CPU without AVX-512 (the tests' way to run that code on a CPU that has AVX-512).
#pragma once

namespace remat {

// True when REMAT_CPU_VARIANT=avx2, false when unset or auto (read once; another value exits with
// a message).
bool cpu_avx2_forced();
// True when the CPU runs AVX-512F and REMAT_CPU_VARIANT does not force AVX2 (the attention's exp and
// fp32 tiles).
bool cpu_avx512();

}  // namespace remat
