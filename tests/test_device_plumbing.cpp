// The CUDA device's plumbing that runs without a GPU: the GEMM description that cuBLASLt errors
// carry, the operand alignment that every cuBLASLt GEMM is prepared for (and refuses below), the
// library loader's error message, init() (which fails cleanly where no GPU exists) and NCCL's
// loading.
#include <boost/test/unit_test.hpp>

#include "cuda_device.h"
#include "nccl.h"

#include <dlfcn.h>

#include <regex>
#include <stdexcept>
#include <string>

using namespace remat;

namespace {

std::string error_of(auto &&f) {
  try {
    f();
  } catch (const std::exception &e) { return e.what(); }
  return {};
}

}  // namespace

BOOST_AUTO_TEST_CASE(gemm_description_names_shape_types_transposes_leading_dimensions_and_epilogue) {
  GemmCall g{.m = 4096, .n = 2304, .k = 768, .trans_b = true, .bf16_in = true};
  BOOST_TEST(describe(g) ==
             "m=4096 n=2304 k=768, a bf16 [m, k] ld 768, b bf16 [n, k] (trans_b) ld 768, out fp32 ld 2304, "
             "epilogue none, beta 0");
  float bias = 0;
  g = {.bias = &bias, .m = 8, .n = 3, .k = 5, .trans_a = true, .bf16_out = true, .accumulate = true};
  BOOST_TEST(describe(g) ==
             "m=8 n=3 k=5, a fp32 [k, m] (trans_a) ld 8, b fp32 [k, n] ld 3, out bf16 ld 3, "
             "epilogue bias, beta 1");
}

BOOST_AUTO_TEST_CASE(gemm_operands_below_16_byte_alignment_are_refused_by_name) {
  alignas(256) static unsigned char memory[1024];
  BOOST_TEST(address_alignment(memory) == 256u);
  BOOST_TEST(address_alignment(memory + 64) == 64u);
  BOOST_TEST(address_alignment(memory + 8) == 8u);
  BOOST_TEST(address_alignment(memory + 3) == 1u);
  GemmCall g{.a = memory, .b = memory + 16, .out = memory + 64, .m = 1, .n = 1, .k = 1};
  BOOST_CHECK_NO_THROW(require_gemm_alignment(g));  // no bias: nothing to check there
  g.bias = memory + 32;
  BOOST_CHECK_NO_THROW(require_gemm_alignment(g));
  g.b = memory + 8;
  const std::string message = error_of([&] { require_gemm_alignment(g); });
  BOOST_TEST_INFO(message);
  BOOST_TEST(message.starts_with("GEMM operand b at 0x"));
  BOOST_TEST(message.find("is only 8-byte aligned") != std::string::npos);
  g.b = memory;
  g.bias = memory + 36;
  BOOST_TEST(error_of([&] { require_gemm_alignment(g); }).starts_with("GEMM operand bias at"));
}

BOOST_AUTO_TEST_CASE(a_library_that_does_not_load_is_reported_with_each_candidate_and_its_dlerror) {
  const std::string message = error_of([] {
    cuda::dlopen_first({"/nonexistent/libremat-a.so", "libremat-b.so.1"}, "the test library", RTLD_NOW | RTLD_LOCAL);
  });
  BOOST_TEST_INFO(message);
  BOOST_TEST(message.starts_with("cannot load the test library; tried /nonexistent/libremat-a.so ("));
  BOOST_TEST(message.find("; libremat-b.so.1 (") != std::string::npos);
  BOOST_TEST(message.find("No such file or directory") != std::string::npos);
  void *lib = cuda::dlopen_first({"/nonexistent/libremat-a.so", "libc.so.6"}, "libc", RTLD_NOW | RTLD_LOCAL);
  BOOST_TEST(lib != nullptr);
  dlclose(lib);
}

// With a usable GPU init() succeeds (the driver found for Halide too); without one it throws a
// message (Halide's default error handler would abort instead).
BOOST_AUTO_TEST_CASE(init_succeeds_with_a_usable_gpu_and_throws_without_one) {
  const cuda::DeviceInfo info = cuda::probe();
  const std::string message = error_of([] { cuda::init(); });
  BOOST_TEST_MESSAGE("probe: " << (info.error.empty() ? info.name : info.error) << "; init: " << message);
  BOOST_TEST(message.empty() == info.error.empty());
}

// NCCL (data-parallel ranks on GPUs) loads on a machine without a GPU: libnccl.so.2 of the library
// path or of the wheel the build found nccl.h in; a communicator's id is made without a GPU too.
BOOST_AUTO_TEST_CASE(nccl_loads_and_makes_a_communicator_id_without_a_gpu) {
#ifdef REMAT_TEST_NCCL
  std::string version;
  const std::string message = error_of([&] { version = cuda::Nccl::version(); });
  BOOST_TEST_INFO(message);
  BOOST_TEST_REQUIRE(message.empty());
  BOOST_TEST_MESSAGE("NCCL " << version);
  BOOST_TEST(std::regex_match(version, std::regex(R"(2\.(19|2[0-9]|[3-9][0-9])\.[0-9]+)")));  // 2.19 or later
  const cuda::NcclId a = cuda::nccl_unique_id(), b = cuda::nccl_unique_id();
  BOOST_TEST((a != b));  // each names its own bootstrap
#else
  const std::string message = error_of([] { cuda::Nccl::version(); });
  BOOST_TEST(message.starts_with("this build of remat has no NCCL"));
#endif
}

// The check every CUDA kernel launch passes on the device (runtime/cuda_device.cpp), against an
// H100's limits: each limit refused by name just above it, accepted at it.
BOOST_AUTO_TEST_CASE(launches_over_the_device_limits_are_refused_by_name) {
  const cuda::Launch fits{{2147483647u, 65535u, 65535u}, {32u, 8u, 4u}, 227u * 1024u};
  BOOST_TEST(cuda::launch_problem(fits).empty());
  cuda::Launch l = fits;
  l.grid[1] = 65536;
  BOOST_TEST(cuda::launch_problem(l) == "65536 blocks on the grid's y axis, the device allows 65535");
  l = fits;
  l.block[2] = 65;
  BOOST_TEST(cuda::launch_problem(l) == "65 threads on the block's z axis, the device allows 64");
  l = fits;
  l.block[0] = 64;
  l.block[1] = 32;  // 64 x 32 x 4 = 8192
  BOOST_TEST(cuda::launch_problem(l) == "8192 threads a block, the device allows 1024");
  l = fits;
  l.shared = 227 * 1024 + 1;
  BOOST_TEST(cuda::launch_problem(l) == "232449 bytes of shared memory a block, the device allows 232448");
  l = fits;
  l.grid[0] = 0;
  BOOST_TEST(cuda::launch_problem(l) == "an empty grid or block on x");
}
