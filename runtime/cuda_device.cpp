#include "cuda_device.h"

#include <stdexcept>
#include <string>

#ifdef REMAT_WITH_CUDA
#include <HalideRuntimeCuda.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

namespace remat::cuda {
namespace {

struct State {
  bool ready = false;
  CUcontext context = nullptr;
  cudaStream_t compute = nullptr, copy = nullptr;
} state;

void check(cudaError_t err, const char *what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(err));
}

cudaStream_t stream(Stream s) { return s == Stream::compute ? state.compute : state.copy; }

// Halide's hooks: every kernel uses the primary context and the compute stream.
int acquire_context(void *, void **ctx, bool) {
  *ctx = state.context;
  return state.context ? 0 : -1;
}
int release_context(void *) { return 0; }
int get_stream(void *, void *, void **s) {
  *s = state.compute;
  return 0;
}

}  // namespace

DeviceInfo probe() {
  DeviceInfo info;
  info.built = true;
  if (cudaError_t err = cudaGetDeviceCount(&info.count); err != cudaSuccess) {
    info.count = 0;
    info.error = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    return info;
  }
  if (info.count == 0) {
    info.error = "no CUDA device";
    return info;
  }
  cudaDeviceProp prop{};
  if (cudaError_t err = cudaGetDeviceProperties(&prop, 0); err != cudaSuccess) {
    info.error = std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(err);
    return info;
  }
  info.name = prop.name;
  info.major = prop.major;
  info.minor = prop.minor;
  if (cudaError_t err = cudaSetDevice(0); err != cudaSuccess) {
    info.error = std::string("cudaSetDevice: ") + cudaGetErrorString(err);
    return info;
  }
  if (cudaError_t err = cudaMemGetInfo(&info.free_bytes, &info.total_bytes); err != cudaSuccess)
    info.error = std::string("cudaMemGetInfo: ") + cudaGetErrorString(err);
  return info;
}

void init() {
  if (state.ready) return;
  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaFree(nullptr), "initializing the primary context");
  // The primary context, through the runtime's entry point to the driver (no link to libcuda).
  void *fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  check(cudaGetDriverEntryPoint("cuCtxGetCurrent", &fn, cudaEnableDefault, &found), "cuCtxGetCurrent");
  if (!fn || found != cudaDriverEntryPointSuccess) throw std::runtime_error("CUDA: the driver has no cuCtxGetCurrent");
  if (reinterpret_cast<CUresult (*)(CUcontext *)>(fn)(&state.context) != CUDA_SUCCESS || !state.context)
    throw std::runtime_error("CUDA: no current context after initialization");
  check(cudaStreamCreateWithFlags(&state.compute, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaStreamCreateWithFlags(&state.copy, cudaStreamNonBlocking), "cudaStreamCreate");
  halide_set_cuda_acquire_context(acquire_context);
  halide_set_cuda_release_context(release_context);
  halide_set_cuda_get_stream(get_stream);
  state.ready = true;
}

void *device_malloc(std::size_t bytes) {
  void *p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
}
void device_free(void *p) { cudaFree(p); }
void *pinned_malloc(std::size_t bytes) {
  void *p = nullptr;
  check(cudaMallocHost(&p, bytes), "cudaMallocHost");
  return p;
}
void pinned_free(void *p) { cudaFreeHost(p); }

void copy_to_device(void *device, const void *host, std::size_t bytes, Stream s) {
  check(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream(s)), "copy to device");
}
void copy_to_host(void *host, const void *device, std::size_t bytes, Stream s) {
  check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream(s)), "copy to host");
}
void synchronize(Stream s) { check(cudaStreamSynchronize(stream(s)), "cudaStreamSynchronize"); }

Event event_create() {
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  return {e};
}
void event_destroy(Event e) { cudaEventDestroy(static_cast<cudaEvent_t>(e.handle)); }
void record(Event e, Stream s) { check(cudaEventRecord(static_cast<cudaEvent_t>(e.handle), stream(s)), "cudaEventRecord"); }
void wait(Stream s, Event e) { check(cudaStreamWaitEvent(stream(s), static_cast<cudaEvent_t>(e.handle), 0), "cudaStreamWaitEvent"); }

}  // namespace remat::cuda

#else  // built without the CUDA toolkit

namespace remat::cuda {
namespace {
[[noreturn]] void unavailable() { throw std::runtime_error("this build of remat has no CUDA support (the CUDA toolkit was not found)"); }
}  // namespace
DeviceInfo probe() { return {.error = "this build of remat has no CUDA support (the CUDA toolkit was not found)"}; }
void init() { unavailable(); }
void *device_malloc(std::size_t) { unavailable(); }
void device_free(void *) {}
void *pinned_malloc(std::size_t) { unavailable(); }
void pinned_free(void *) {}
void copy_to_device(void *, const void *, std::size_t, Stream) { unavailable(); }
void copy_to_host(void *, const void *, std::size_t, Stream) { unavailable(); }
void synchronize(Stream) { unavailable(); }
Event event_create() { unavailable(); }
void event_destroy(Event) {}
void record(Event, Stream) { unavailable(); }
void wait(Stream, Event) { unavailable(); }
}  // namespace remat::cuda

#endif
