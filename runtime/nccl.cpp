#include "nccl.h"

#include <stdexcept>

#if defined(REMAT_WITH_CUDA) && defined(REMAT_WITH_NCCL)
#include "cuda_device.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

namespace remat::cuda {
namespace {

struct NcclLibrary {
  // clang-format off
#define REMAT_NCCL_FUNCTIONS(X)                                                                        \
  X(ncclGetVersion) X(ncclGetUniqueId) X(ncclCommInitRank) X(ncclCommDestroy) X(ncclCommAbort)         \
  X(ncclCommGetAsyncError) X(ncclGetErrorString) X(ncclGetLastError) X(ncclAllReduce) X(ncclReduce)    \
  X(ncclBroadcast) X(ncclGroupStart) X(ncclGroupEnd)
  // clang-format on
#define REMAT_DECLARE(name) decltype(&::name) name = nullptr;
  REMAT_NCCL_FUNCTIONS(REMAT_DECLARE)
#undef REMAT_DECLARE

  NcclLibrary() {
    std::vector<std::string> candidates = {"libnccl.so.2"};
#ifdef REMAT_NCCL_LIBRARY
    candidates.insert(candidates.begin(), REMAT_NCCL_LIBRARY);  // the wheel the build found nccl.h in
#endif
    // an empty name would be dlopen("")'s main program, which has no NCCL
    if (const char *path = std::getenv("REMAT_NCCL"); path && *path) candidates.insert(candidates.begin(), path);
    void *lib = dlopen_first(
        candidates,
        "libnccl.so.2 (NCCL; pip install nvidia-nccl-cu13, put it on LD_LIBRARY_PATH or name it in REMAT_NCCL)",
        RTLD_NOW | RTLD_LOCAL);
#define REMAT_LOAD(name)                                      \
  name = reinterpret_cast<decltype(name)>(dlsym(lib, #name)); \
  if (!name) throw std::runtime_error("NCCL: libnccl.so.2 has no " #name);
    REMAT_NCCL_FUNCTIONS(REMAT_LOAD)
#undef REMAT_LOAD
  }
  void check(ncclResult_t result, const char *what, ncclComm_t comm = nullptr) const {
    if (result == ncclSuccess) return;
    const char *detail = comm ? ncclGetLastError(comm) : nullptr;
    throw std::runtime_error(fmt::format("NCCL: {}: {}{}", what, ncclGetErrorString(result),
                                         detail && *detail ? fmt::format(" ({})", detail) : ""));
  }
};

NcclLibrary &nccl() {
  static NcclLibrary library;
  return library;
}

ncclComm_t as_comm(void *comm) { return static_cast<ncclComm_t>(comm); }
cudaStream_t collectives() { return static_cast<cudaStream_t>(native_stream(Stream::collectives)); }

}  // namespace

NcclId nccl_unique_id() {
  ncclUniqueId id;
  nccl().check(nccl().ncclGetUniqueId(&id), "ncclGetUniqueId");
  NcclId out;
  std::memcpy(out.data(), id.internal, sizeof id.internal);
  return out;
}

Nccl::Nccl(const NcclId &id, int rank, int size) {
  static_assert(sizeof(ncclUniqueId) == std::tuple_size_v<NcclId>);
  ncclUniqueId unique;
  std::memcpy(unique.internal, id.data(), sizeof unique.internal);
  ncclComm_t c = nullptr;
  nccl().check(nccl().ncclCommInitRank(&c, size, unique, rank), "ncclCommInitRank");
  comm = c;
}

Nccl::~Nccl() {
  // Destroying (or aborting) a communicator is collective among the ranks of a machine: a rank
  // leaving on an exception would wait there for ranks that are not coming (they wait in a
  // collective for it). It leaves the communicator to the process's end (MPI_Abort follows).
  if (!comm || std::uncaught_exceptions() > 0) return;
  ncclResult_t failed = ncclSuccess;
  // a communicator whose peers failed would wait for them in ncclCommDestroy
  if (nccl().ncclCommGetAsyncError(as_comm(comm), &failed) == ncclSuccess && failed == ncclSuccess)
    nccl().ncclCommDestroy(as_comm(comm));
  else
    nccl().ncclCommAbort(as_comm(comm));
}

void Nccl::all_reduce(float *v, std::size_t n) const {
  nccl().check(nccl().ncclAllReduce(v, v, n, ncclFloat32, ncclSum, as_comm(comm), collectives()), "ncclAllReduce",
               as_comm(comm));
}
void Nccl::reduce(float *v, std::size_t n, int root) const {
  nccl().check(nccl().ncclReduce(v, v, n, ncclFloat32, ncclSum, root, as_comm(comm), collectives()), "ncclReduce",
               as_comm(comm));
}
void Nccl::broadcast(float *v, std::size_t n, int root) const {
  nccl().check(nccl().ncclBroadcast(v, v, n, ncclFloat32, root, as_comm(comm), collectives()), "ncclBroadcast",
               as_comm(comm));
}
void Nccl::group_start() const { nccl().check(nccl().ncclGroupStart(), "ncclGroupStart"); }
void Nccl::group_end() const { nccl().check(nccl().ncclGroupEnd(), "ncclGroupEnd", as_comm(comm)); }

void Nccl::check() const {
  ncclResult_t failed = ncclSuccess;
  nccl().check(nccl().ncclCommGetAsyncError(as_comm(comm), &failed), "ncclCommGetAsyncError");
  nccl().check(failed, "a collective failed", as_comm(comm));
}

std::string Nccl::version() {
  int v = 0;
  nccl().check(nccl().ncclGetVersion(&v), "ncclGetVersion");
  return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);  // NCCL_VERSION_CODE since 2.9
}

}  // namespace remat::cuda

#else  // built without the CUDA toolkit or NCCL's header

namespace remat::cuda {
namespace {
[[noreturn]] void unavailable() {
  throw std::runtime_error(
      "this build of remat has no NCCL (the CUDA toolkit or the nvidia-nccl-cu13 wheel's nccl.h was not found)");
}
}  // namespace
NcclId nccl_unique_id() { unavailable(); }
Nccl::Nccl(const NcclId &, int, int) { unavailable(); }
Nccl::~Nccl() = default;
void Nccl::all_reduce(float *, std::size_t) const { unavailable(); }
void Nccl::reduce(float *, std::size_t, int) const { unavailable(); }
void Nccl::broadcast(float *, std::size_t, int) const { unavailable(); }
void Nccl::group_start() const { unavailable(); }
void Nccl::group_end() const { unavailable(); }
void Nccl::check() const { unavailable(); }
std::string Nccl::version() { unavailable(); }
}  // namespace remat::cuda

#endif
