#include "cpu_variant.h"

#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace remat {

bool cpu_avx2_forced() {
  static const bool forced = [] {
    const char *v = std::getenv("REMAT_CPU_VARIANT");
    if (!v || !*v || std::string_view(v) == "auto") return false;
    if (std::string_view(v) == "avx2") return true;
    std::fprintf(stderr, "REMAT_CPU_VARIANT=%s: expected avx2 or auto\n", v);
    std::exit(2);
  }();
  return forced;
}

bool cpu_avx512() {
  static const bool avx512 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && !cpu_avx2_forced();
  }();
  return avx512;
}

}  // namespace remat
