// A CUDA kernel launch's shape and the limits of the device it must fit (by default an H100's
// and H200's, compute capability 9.0; runtime/cuda_device.cpp reads the device's own), and the one
// check of the one against the other: the model compiler's at generation (generators/cuda_launches.h),
// the runtime's at every launch of a Halide kernel, and test_cuda's on the launch reports. Dynamic
// shared memory above `shared_default` needs the kernel's opt-in (cuFuncSetAttribute), which
// Halide's runtime does not do: remat's launch check opts in.
#pragma once

#include <string>

namespace remat::cuda {

struct LaunchLimits {
  unsigned grid[3] = {2147483647u, 65535u, 65535u}, block[3] = {1024u, 1024u, 64u};
  unsigned threads = 1024, shared_default = 48 * 1024, shared_opt_in = 227 * 1024;
};
struct Launch {
  unsigned grid[3], block[3], shared;
};

// Why `l` cannot launch under `limits`, in words ("" when it can).
inline std::string launch_problem(const Launch &l, const LaunchLimits &limits = {}) {
  using std::to_string;
  const char *axis[3] = {"x", "y", "z"};
  for (int d = 0; d < 3; ++d) {
    if (l.grid[d] == 0 || l.block[d] == 0) return std::string("an empty grid or block on ") + axis[d];
    if (l.grid[d] > limits.grid[d])
      return to_string(l.grid[d]) + " blocks on the grid's " + axis[d] + " axis, the device allows " +
             to_string(limits.grid[d]);
    if (l.block[d] > limits.block[d])
      return to_string(l.block[d]) + " threads on the block's " + axis[d] + " axis, the device allows " +
             to_string(limits.block[d]);
  }
  if (const unsigned long threads = 1ul * l.block[0] * l.block[1] * l.block[2]; threads > limits.threads)
    return to_string(threads) + " threads a block, the device allows " + to_string(limits.threads);
  if (l.shared > limits.shared_opt_in)
    return to_string(l.shared) + " bytes of shared memory a block, the device allows " +
           to_string(limits.shared_opt_in);
  return "";
}

}  // namespace remat::cuda
