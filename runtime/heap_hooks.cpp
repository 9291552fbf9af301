// Heap use that the plan does not see, counted so the measured peak includes it.
// - Halide kernels allocate through halide_malloc / halide_free (weak in Halide's runtime): these
//   strong definitions count the bytes a kernel allocates.
// - Everything else: this file interposes the C allocation functions (the program's definitions
//   win over glibc's for every library in the process, libstdc++'s operator new included) and
//   forwards them to glibc's own. While the executor runs a phase (remat_heap_counting), every
//   allocation on any thread is counted with its bytes. free is not interposed: every block still
//   comes from glibc's allocator. Under AddressSanitizer (make test-sanitize, make fuzz), whose
//   allocator must see every block, nothing is interposed: its malloc hook counts instead.
// - Anonymous mmap by the program or a library (MKL's, Halide's own pools) is counted the same
//   way; glibc's calls its internal __mmap, which is not interposed (malloc's large blocks were
//   counted at malloc; thread stacks that pthread_create maps are not seen).
// - REMAT_HEAP_STACKS=1: the first 8 counted allocations of the process also print their call
//   stacks to stderr (what a failing "no heap in a step" check needs; backtrace_symbols_fd does
//   not allocate).
#include <HalideRuntime.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <execinfo.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define REMAT_ASAN 1
#include <sanitizer/allocator_interface.h>
#endif
#endif

extern "C" {
void *__libc_malloc(size_t);
void *__libc_calloc(size_t, size_t);
void *__libc_realloc(void *, size_t);
void *__libc_memalign(size_t, size_t);

std::atomic<bool> remat_heap_counting{false};
std::atomic<size_t> remat_heap_allocations{0}, remat_heap_bytes{0};

// Called for each counted allocation: `break remat_heap_counted` in gdb shows who allocated.
__attribute__((noinline)) void remat_heap_counted(size_t bytes) { asm volatile("" ::"r"(bytes)); }

static const bool print_stacks = std::getenv("REMAT_HEAP_STACKS") != nullptr;
static thread_local bool in_stack = false;  // what backtrace() itself allocates (its first call) is not counted

static void print_stack(size_t bytes) {
  in_stack = true;
  char head[96];
  const int n = std::snprintf(head, sizeof head, "remat: %zu bytes allocated in a step, from:\n", bytes);
  if (n > 0 && ::write(2, head, size_t(n)) < 0) std::abort();
  void *frames[48];
  backtrace_symbols_fd(frames, backtrace(frames, 48), 2);
  in_stack = false;
}

static inline void count(size_t bytes) {
  if (!remat_heap_counting.load(std::memory_order_relaxed) || in_stack) return;
  remat_heap_counted(bytes);
  remat_heap_allocations.fetch_add(1, std::memory_order_relaxed);
  remat_heap_bytes.fetch_add(bytes, std::memory_order_relaxed);
  static std::atomic<int> printed{0};  // the first few: a library compiling in a step allocates millions of times
  if (print_stacks && printed.fetch_add(1, std::memory_order_relaxed) < 8) print_stack(bytes);
}

#ifdef REMAT_ASAN
static thread_local bool in_halide_malloc = false;  // halide_malloc's blocks are counted apart
static void counted(const volatile void *, size_t bytes) {
  if (!in_halide_malloc) count(bytes);
}
static void freed(const volatile void *) {}  // (the sanitizer installs no hook without both)
[[maybe_unused]] static const int hooks = __sanitizer_install_malloc_and_free_hooks(counted, freed);
static void *halide_block(size_t alignment, size_t bytes) {
  in_halide_malloc = true;
  void *p = std::aligned_alloc(alignment, bytes);
  in_halide_malloc = false;
  return p;
}
#else
static void *halide_block(size_t alignment, size_t bytes) { return __libc_memalign(alignment, bytes); }

void *malloc(size_t bytes) {
  count(bytes);
  return __libc_malloc(bytes);
}
void *calloc(size_t n, size_t size) {
  size_t bytes;
  count(__builtin_mul_overflow(n, size, &bytes) ? SIZE_MAX : bytes);
  return __libc_calloc(n, size);
}
void *realloc(void *p, size_t bytes) {
  count(bytes);
  return __libc_realloc(p, bytes);
}
void *aligned_alloc(size_t alignment, size_t bytes) {
  count(bytes);
  return __libc_memalign(alignment, bytes);
}
void *memalign(size_t alignment, size_t bytes) {
  count(bytes);
  return __libc_memalign(alignment, bytes);
}
void *valloc(size_t bytes) {
  count(bytes);
  return __libc_memalign(size_t(sysconf(_SC_PAGESIZE)), bytes);
}
void *pvalloc(size_t bytes) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  count(bytes);
  return __libc_memalign(page, (bytes + page - 1) / page * page);
}
void *mmap(void *address, size_t bytes, int protection, int flags, int fd, off_t offset) {
  if (flags & MAP_ANONYMOUS) count(bytes);
  return reinterpret_cast<void *>(syscall(SYS_mmap, address, bytes, protection, flags, fd, offset));
}
void *mmap64(void *address, size_t bytes, int protection, int flags, int fd, off_t offset) {
  return mmap(address, bytes, protection, flags, fd, offset);
}
int posix_memalign(void **out, size_t alignment, size_t bytes) {
  if (alignment == 0 || alignment % sizeof(void *) != 0 || (alignment & (alignment - 1)) != 0) return EINVAL;
  count(bytes);
  void *p = __libc_memalign(alignment, bytes);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
#endif

std::atomic<size_t> remat_halide_heap_current{0}, remat_halide_heap_peak{0};

void *halide_malloc(void *, size_t bytes) {
  // Halide wants 128-byte alignment; the size word sits in front of the returned block.
  constexpr size_t header = 128;
  auto *raw = static_cast<unsigned char *>(halide_block(header, (bytes + 2 * header - 1) / header * header));
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
  std::free(raw);  // the block came from halide_block
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
