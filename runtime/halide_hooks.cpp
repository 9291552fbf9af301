// Halide kernels allocate through halide_malloc / halide_free (weak in Halide's runtime). These
// strong definitions count the bytes so the measured peak includes anything a kernel allocates.
#include <HalideRuntime.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

extern "C" {
std::atomic<size_t> remat_halide_heap_current{0}, remat_halide_heap_peak{0};

void *halide_malloc(void *, size_t bytes) {
  // Halide wants 128-byte alignment; the size word sits in front of the returned block.
  constexpr size_t header = 128;
  auto *raw = static_cast<unsigned char *>(std::aligned_alloc(header, (bytes + 2 * header - 1) / header * header));
  if (!raw) return nullptr;
  std::memcpy(raw, &bytes, sizeof bytes);
  if (std::getenv("REMAT_TRACE_HEAP")) std::fprintf(stderr, "halide_malloc %zu bytes\n", bytes);
  const size_t now = remat_halide_heap_current += bytes;
  size_t peak = remat_halide_heap_peak.load();
  while (now > peak && !remat_halide_heap_peak.compare_exchange_weak(peak, now)) {}
  return raw + header;
}

void halide_free(void *, void *ptr) {
  if (!ptr) return;
  auto *raw = static_cast<unsigned char *>(ptr) - 128;
  size_t bytes;
  std::memcpy(&bytes, raw, sizeof bytes);
  remat_halide_heap_current -= bytes;
  std::free(raw);
}
}

// Halide's default error handler aborts the process. Keep the messages instead (the first, the
// cause, first; an extern stage writes its own before Halide reports the failed stage); the
// executor turns a failing kernel's error code and these messages into an exception.
extern "C" {
char remat_halide_error[1024];

void halide_error(void *, const char *msg) {
  size_t n = std::strlen(remat_halide_error);
  if (n > 0 && n + 2 < sizeof remat_halide_error) {
    std::strcat(remat_halide_error, "; ");
    n += 2;
  }
  std::strncat(remat_halide_error, msg, sizeof remat_halide_error - 1 - n);
  n = std::strlen(remat_halide_error);
  if (n > 0 && remat_halide_error[n - 1] == '\n') remat_halide_error[n - 1] = 0;
}
}
