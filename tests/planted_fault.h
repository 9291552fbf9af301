// A test-only kernel: the real one, then a planted fault (a write 2 bytes past one of its buffer
// arguments, or a heap allocation), so that tests show each check of the executor fires
// (tests/test_arena.cpp on the CPU, tests/test_cuda.cpp on the device). Include after
// `import remat; import remat.runtime;`. Everything is in remat::testing.
#pragma once

#include <boost/test/unit_test.hpp>

#include <HalideRuntime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace remat::testing {

struct Planted {
  int (*real)(void **) = nullptr;
  int call = 0, on_call = 0;  // the fault is planted on that call of the kernel (0: the first)
  int argument = -1;          // overrun: write 2 bytes past the end of this buffer argument
  std::size_t allocate = 0;   // allocate (and free) this many bytes from the heap
  // the overrun's write, when the buffer is not in host memory (CUDA: past buf->device); by
  // default 2 zero bytes at buf->host + buf->size_in_bytes()
  void (*overrun)(halide_buffer_t *buf) = nullptr;
};
inline Planted planted;

inline int faulty_kernel(void **args) {
  const int err = planted.real(args);
  if (planted.call++ != planted.on_call) return err;
  if (planted.argument >= 0) {
    auto *buf = static_cast<halide_buffer_t *>(args[planted.argument]);
    if (planted.overrun)
      planted.overrun(buf);
    else
      std::memset(buf->host + buf->size_in_bytes(), 0, 2);
  }
  if (planted.allocate) {
    void *volatile p = std::malloc(planted.allocate);
    std::free(p);
  }
  return err;
}

// The kernel table with `name` replaced by the faulty kernel.
inline std::vector<remat::runtime::Kernel> with_fault(std::span<const remat::runtime::Kernel> table, const std::string &name,
                                                      Planted fault) {
  std::vector<remat::runtime::Kernel> out(table.begin(), table.end());
  auto it = std::ranges::find_if(out, [&](const remat::runtime::Kernel &k) { return name == k.name; });
  BOOST_TEST_REQUIRE((it != out.end()), name);
  fault.real = it->argv;
  planted = fault;
  it->argv = faulty_kernel;
  return out;
}

// Position of the kernel argument the plan calls `arg`.
inline int argument_index(const remat::runtime::Kernel &k, std::string_view arg) {
  const halide_filter_metadata_t *md = k.metadata();
  for (int a = 0; a < md->num_arguments; ++a)
    if (remat::runtime::plan_argument_name(md->arguments[a].name) == arg) return a;
  return -1;
}

}  // namespace remat::testing
