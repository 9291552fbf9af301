// The CUDA device behind `--device cuda`: device 0's primary context, a compute stream that every
// Halide kernel runs on (Halide's context and stream hooks point at them) and a copy stream for
// offload. Plain C++ interface (no CUDA types); built against the CUDA runtime when the CUDA
// toolkit was found (REMAT_WITH_CUDA), otherwise every call reports that.
#pragma once

#include "gemm.h"

#include <cstddef>
#include <string>
#include <vector>

namespace remat::cuda {

// What `--device cuda` would get; never throws.
struct DeviceInfo {
  bool built = false;  // compiled with the CUDA runtime
  int count = 0;       // devices found
  std::string error;   // why none is usable (empty: device 0 is usable)
  std::string name;
  std::size_t free_bytes = 0, total_bytes = 0;
  int major = 0, minor = 0;
};
DeviceInfo probe();

// Device 0 made current; streams created; Halide's hooks installed; Halide's CUDA state released
// at exit. Idempotent.
void init();

// dlopen of the first candidate that loads (flags as dlopen's); otherwise throws "cannot load
// <what>", with each candidate and its dlerror().
void *dlopen_first(const std::vector<std::string> &candidates, const std::string &what, int flags);

void *device_malloc(std::size_t bytes);
void device_free(void *p);
void *pinned_malloc(std::size_t bytes);
void pinned_free(void *p);

enum class Stream { compute, copy };
void copy_to_device(void *device, const void *host, std::size_t bytes, Stream s);  // async
void copy_to_host(void *host, const void *device, std::size_t bytes, Stream s);    // async
void synchronize(Stream s);

// Events order the two streams without device-wide synchronization.
struct Event {
  void *handle = nullptr;
};
Event event_create();
void event_destroy(Event e);
void record(Event e, Stream s);
void wait(Stream s, Event e);  // s waits for e (on the device)

// One GEMM with cuBLASLt on the compute stream (device pointers in g). cuBLASLt is loaded on first
// use (libcublasLt.so.<major> from the library path or the CUDA toolkit; REMAT_CUBLASLT names
// another file), with no workspace, so that device memory stays exactly the plan's.
void gemm(const GemmCall &g);

}  // namespace remat::cuda
