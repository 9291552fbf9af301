// NCCL between the GPUs of data-parallel ranks (one GPU each): the gradient collectives of
// `mpirun -np N train-* --device cuda`, in place in the arena, on the collectives stream
// (cuda_device.h). libnccl.so.2 is loaded with dlopen on first use (the binaries start without it):
// REMAT_NCCL names the file, otherwise the nvidia-nccl-cu13 wheel the build found nccl.h in (its
// version), then the library path. Built when the CUDA toolkit and that header were found (REMAT_WITH_NCCL);
// otherwise every call reports that.
#pragma once

#include <array>
#include <cstddef>
#include <string>

namespace remat::cuda {

using NcclId = std::array<char, 128>;  // ncclUniqueId: rank 0 makes it, every rank gets it (MPI)
NcclId nccl_unique_id();

// One rank's communicator on the selected device (init() first).
class Nccl {
public:
  Nccl(const NcclId &id, int rank, int size);  // every rank at once (ncclCommInitRank)
  ~Nccl();
  // fp32 sums, in place, queued on the collectives stream. reduce: root's v becomes the sum.
  void all_reduce(float *v, std::size_t n) const;
  void reduce(float *v, std::size_t n, int root) const;
  void broadcast(float *v, std::size_t n, int root) const;  // root's v to every rank
  // The calls between these are one launch (ncclGroupStart / ncclGroupEnd).
  void group_start() const;
  void group_end() const;
  void check() const;            // throws a collective's asynchronous failure (a peer gone, a network error)
  static std::string version();  // of the loaded library, "2.30.7"
  Nccl(const Nccl &) = delete;
  Nccl &operator=(const Nccl &) = delete;

private:
  void *comm = nullptr;
};

}  // namespace remat::cuda
