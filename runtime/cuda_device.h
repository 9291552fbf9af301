// The CUDA device behind `--device cuda`: the selected device's primary context (device 0, or a
// data-parallel rank's own), a compute stream that every Halide kernel runs on (Halide's context
// and stream hooks point at them), a copy stream for offload and a collectives stream for NCCL. Plain C++ interface (no
// CUDA types); built against the CUDA runtime when the CUDA toolkit was found (REMAT_WITH_CUDA), otherwise every call
// reports that.
#pragma once

#include "gemm.h"
#include "launch_limits.h"

#include <cstddef>
#include <string>
#include <vector>

namespace remat::cuda {

// The device init() makes current (default 0): a data-parallel rank's GPU is its rank on its
// machine, or 0 where the process sees one GPU only (a launcher that gives each rank its own with
// CUDA_VISIBLE_DEVICES). Before init(); throws after it with another device.
void select_device(int ordinal);
int selected_device();

// What `--device cuda` would get (the selected device); never throws.
struct DeviceInfo {
  bool built = false;  // compiled with the CUDA runtime
  int count = 0;       // devices found
  std::string error;   // why none is usable (empty: the selected device is usable)
  std::string name;
  std::size_t free_bytes = 0, total_bytes = 0;
  int major = 0, minor = 0;
};
DeviceInfo probe();

// The selected device made current; streams created; Halide's hooks installed; Halide's CUDA state released
// at exit. Idempotent.
void init();

// dlopen of the first candidate that loads (flags as dlopen's); otherwise throws "cannot load
// <what>", with each candidate and its dlerror().
void *dlopen_first(const std::vector<std::string> &candidates, const std::string &what, int flags);

void *device_malloc(std::size_t bytes);
void device_free(void *p);
void *pinned_malloc(std::size_t bytes);
void pinned_free(void *p);

enum class Stream { compute, copy, collectives };
void *native_stream(Stream s);    // its cudaStream_t
std::size_t device_used_bytes();  // of the selected device, by this process and any other
void copy_to_device(void *device, const void *host, std::size_t bytes, Stream s);  // async
void copy_to_host(void *host, const void *device, std::size_t bytes, Stream s);    // async
void synchronize(Stream s);

// Events order the streams without device-wide synchronization; timed ones also measure them.
struct Event {
  void *handle = nullptr;
};
Event event_create(bool timed = false);
void event_destroy(Event e);
void record(Event e, Stream s);
void wait(Stream s, Event e);            // s waits for e (on the device)
void synchronize(Event e);               // the host waits for e
bool done(Event e);                      // e has happened (cudaEventQuery)
float elapsed_ms(Event from, Event to);  // both timed and done

// One GEMM with cuBLASLt on the compute stream (device pointers in g). cuBLASLt is loaded on first
// use (libcublasLt.so.<major> from the library path or the CUDA toolkit; REMAT_CUBLASLT names
// another file), with no workspace, so that device memory stays exactly the plan's.
void gemm(const GemmCall &g);

}  // namespace remat::cuda
