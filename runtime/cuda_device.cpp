#include "cuda_device.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace remat::cuda {

void *dlopen_first(const std::vector<std::string> &candidates, const std::string &what, int flags) {
  std::string tried;
  for (const std::string &c : candidates) {
    if (void *lib = dlopen(c.c_str(), flags)) return lib;
    const char *why = dlerror();
    tried += (tried.empty() ? "" : "; ") + c + " (" + (why ? why : "not loaded") + ")";
  }
  throw std::runtime_error("cannot load " + what + "; tried " + tried);
}
}  // namespace remat::cuda

#ifdef REMAT_WITH_CUDA
#include <HalideRuntimeCuda.h>
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

// Halide's CUDA runtime is in the kernels' archives when they were generated with CUDA
// (REMAT_CUDA_CAPABILITY != 0): weak here, so that the runtime links with kernels without it.
#pragma weak halide_cuda_device_interface
#pragma weak halide_set_cuda_acquire_context
#pragma weak halide_set_cuda_release_context
#pragma weak halide_set_cuda_get_stream

namespace remat::cuda {
namespace {

struct State {
  bool ready = false;
  int device = 0;
  CUcontext context = nullptr;
  cudaStream_t compute = nullptr, copy = nullptr, collectives = nullptr;
} state;

void check(cudaError_t err, const char *what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(err));
}

cudaStream_t stream(Stream s) {
  return s == Stream::compute ? state.compute : s == Stream::copy ? state.copy : state.collectives;
}

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

// ---- Halide's kernel launches ----
// Halide's CUDA runtime takes each driver function it calls from halide_get_library_symbol, whose
// hook init() sets to `library_symbol`: cuLaunchKernel becomes `checked_launch`, which names a
// kernel whose launch the device's limits refuse (the driver would only say
// CUDA_ERROR_INVALID_VALUE) and opts a kernel into dynamic shared memory above 48 KiB.
using LaunchKernel = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  CUstream, void **, void **);
LaunchKernel driver_launch = nullptr;
LaunchLimits device_limits;

template <class F>
F driver_function(const char *name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));  // libcuda.so.1 is global (init())
}
const char *kernel_name(CUfunction f) {
  using GetName = CUresult (*)(const char **, CUfunction);
  static const auto get_name = driver_function<GetName>("cuFuncGetName");  // drivers of CUDA 12.3 and later
  const char *name = nullptr;
  return get_name && get_name(&name, f) == CUDA_SUCCESS && name ? name : "(a kernel: the driver does not name it)";
}
CUresult checked_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, CUstream stream, void **params, void **extra) {
  if (const std::string problem = launch_problem({{gx, gy, gz}, {bx, by, bz}, shared}, device_limits);
      !problem.empty()) {
    std::fprintf(stderr, "remat: CUDA kernel %s cannot launch on this GPU: %s\n", kernel_name(f), problem.c_str());
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (shared > device_limits.shared_default) {
    using SetAttribute = CUresult (*)(CUfunction, CUfunction_attribute, int);
    static const auto set_attribute = driver_function<SetAttribute>("cuFuncSetAttribute");
    const CUresult err = set_attribute ? set_attribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(shared))
                                       : CUDA_ERROR_NOT_FOUND;
    if (err != CUDA_SUCCESS) {
      std::fprintf(stderr, "remat: CUDA kernel %s: the driver refused %u bytes of dynamic shared memory (error %d)\n",
                   kernel_name(f), shared, int(err));
      return err;
    }
  }
  return driver_launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
}
void *library_symbol(void *lib, const char *name) {
  void *symbol = halide_default_get_library_symbol(lib, name);
  if (!symbol || std::strcmp(name, "cuLaunchKernel") != 0) return symbol;
  driver_launch = reinterpret_cast<LaunchKernel>(symbol);
  return reinterpret_cast<void *>(&checked_launch);
}

// The device's limits, for checked_launch.
LaunchLimits limits_of(int device) {
  LaunchLimits l;
  auto read = [&](cudaDeviceAttr attribute, unsigned &to) {
    int value = 0;
    check(cudaDeviceGetAttribute(&value, attribute, device), "cudaDeviceGetAttribute");
    to = unsigned(value);
  };
  read(cudaDevAttrMaxGridDimX, l.grid[0]);
  read(cudaDevAttrMaxGridDimY, l.grid[1]);
  read(cudaDevAttrMaxGridDimZ, l.grid[2]);
  read(cudaDevAttrMaxBlockDimX, l.block[0]);
  read(cudaDevAttrMaxBlockDimY, l.block[1]);
  read(cudaDevAttrMaxBlockDimZ, l.block[2]);
  read(cudaDevAttrMaxThreadsPerBlock, l.threads);
  read(cudaDevAttrMaxSharedMemoryPerBlock, l.shared_default);
  read(cudaDevAttrMaxSharedMemoryPerBlockOptin, l.shared_opt_in);
  return l;
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
  if (state.device >= info.count) {
    info.error = fmt::format("no CUDA device {} (one GPU per rank on a machine)", state.device);
    return info;
  }
  cudaDeviceProp prop{};
  if (cudaError_t err = cudaGetDeviceProperties(&prop, state.device); err != cudaSuccess) {
    info.error = std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(err);
    return info;
  }
  info.name = prop.name;
  info.major = prop.major;
  info.minor = prop.minor;
  if (cudaError_t err = cudaSetDevice(state.device); err != cudaSuccess) {
    info.error = std::string("cudaSetDevice: ") + cudaGetErrorString(err);
    return info;
  }
  if (cudaError_t err = cudaMemGetInfo(&info.free_bytes, &info.total_bytes); err != cudaSuccess)
    info.error = std::string("cudaMemGetInfo: ") + cudaGetErrorString(err);
  return info;
}

// At exit, before the CUDA runtime's own teardown (atexit handlers run in reverse order of
// registration): Halide's CUDA state (its modules in the primary context) is released while the
// context still exists. Then the acquire hook has no context to give (it returns -1), so nothing
// Halide does later (its own destructor) gets the stale one.
void release_halide() {
  if (!state.context) return;  // init() failed before the context was known: Halide never ran
  halide_device_release(nullptr, halide_cuda_device_interface());
  state.context = nullptr;
}

void init() {
  if (state.ready) return;
  if (!&halide_set_cuda_acquire_context)
    throw std::runtime_error("CUDA: the kernels linked here were generated without CUDA (REMAT_CUDA_CAPABILITY 0)");
  // Halide's CUDA runtime finds the driver with dlsym(RTLD_DEFAULT) or dlopen("libcuda.so"), but
  // containers often have only libcuda.so.1, which the static CUDA runtime opens privately: made
  // global here, the driver's symbols are visible to Halide.
  dlopen_first({"libcuda.so.1"}, "the CUDA driver for Halide's kernels", RTLD_NOW | RTLD_GLOBAL);
  check(cudaSetDevice(state.device), "cudaSetDevice");
  check(cudaFree(nullptr), "initializing the primary context");
  // once, even when init() is tried again after a throw (after the CUDA runtime's own handler)
  static bool release_registered = false;
  if (!release_registered) release_registered = std::atexit(release_halide) == 0;
  // The primary context, through the runtime's entry point to the driver (no link to libcuda).
  void *fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  check(cudaGetDriverEntryPoint("cuCtxGetCurrent", &fn, cudaEnableDefault, &found), "cuCtxGetCurrent");
  if (!fn || found != cudaDriverEntryPointSuccess) throw std::runtime_error("CUDA: the driver has no cuCtxGetCurrent");
  if (reinterpret_cast<CUresult (*)(CUcontext *)>(fn)(&state.context) != CUDA_SUCCESS || !state.context)
    throw std::runtime_error("CUDA: no current context after initialization");
  check(cudaStreamCreateWithFlags(&state.compute, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaStreamCreateWithFlags(&state.copy, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaStreamCreateWithFlags(&state.collectives, cudaStreamNonBlocking), "cudaStreamCreate");
  device_limits = limits_of(state.device);
  halide_set_custom_get_library_symbol(library_symbol);  // before Halide's CUDA runtime loads the driver
  halide_set_cuda_acquire_context(acquire_context);
  halide_set_cuda_release_context(release_context);
  halide_set_cuda_get_stream(get_stream);
  state.ready = true;
}

void select_device(int ordinal) {
  if (int count = 0; cudaGetDeviceCount(&count) == cudaSuccess && count == 1) ordinal = 0;
  if (state.ready && ordinal != state.device)
    throw std::logic_error(
        fmt::format("CUDA device {} selected after device {} was initialized", ordinal, state.device));
  state.device = ordinal;
}
int selected_device() { return state.device; }

void *native_stream(Stream s) { return stream(s); }

std::size_t device_used_bytes() {
  std::size_t free_bytes = 0, total_bytes = 0;
  check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return total_bytes - free_bytes;
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

Event event_create(bool timed) {
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, timed ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreate");
  return {e};
}
void event_destroy(Event e) { cudaEventDestroy(static_cast<cudaEvent_t>(e.handle)); }
void record(Event e, Stream s) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(e.handle), stream(s)), "cudaEventRecord");
}
void wait(Stream s, Event e) {
  check(cudaStreamWaitEvent(stream(s), static_cast<cudaEvent_t>(e.handle), 0), "cudaStreamWaitEvent");
}
void synchronize(Event e) { check(cudaEventSynchronize(static_cast<cudaEvent_t>(e.handle)), "cudaEventSynchronize"); }
bool done(Event e) {
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(e.handle));
  if (err == cudaErrorNotReady) return false;
  check(err, "cudaEventQuery");
  return true;
}
float elapsed_ms(Event from, Event to) {
  float ms = 0;
  check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(from.handle), static_cast<cudaEvent_t>(to.handle)),
        "cudaEventElapsedTime");
  return ms;
}

// ---- cuBLASLt, loaded with dlopen (the binaries start, and the CPU runs work, without it) ----
namespace {

struct CublasLt {
  // clang-format off
#define REMAT_CUBLASLT_FUNCTIONS(X)                                                                    \
  X(cublasLtCreate) X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescSetAttribute)                      \
  X(cublasLtMatrixLayoutCreate) X(cublasLtMatmulPreferenceCreate) X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatmulAlgoGetHeuristic) X(cublasLtMatmul) X(cublasLtGetStatusString)                       \
  X(cublasLtMatmulPreferenceDestroy)
// clang-format on
#define REMAT_DECLARE(name) decltype(&::name) name = nullptr;
  REMAT_CUBLASLT_FUNCTIONS(REMAT_DECLARE)
#undef REMAT_DECLARE
  cublasLtHandle_t handle = nullptr;

  CublasLt() {
    const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
    std::vector<std::string> candidates = {soname, "/usr/local/cuda/lib64/" + soname,
                                           "/usr/local/cuda/targets/x86_64-linux/lib/" + soname};
    // an empty name would be dlopen("")'s main program, which has no cuBLASLt
    if (const char *path = std::getenv("REMAT_CUBLASLT"); path && *path) candidates.insert(candidates.begin(), path);
    void *lib = dlopen_first(candidates, soname + " (cuBLASLt; put it on LD_LIBRARY_PATH or name it in REMAT_CUBLASLT)",
                             RTLD_NOW | RTLD_LOCAL);
#define REMAT_LOAD(name)                                      \
  name = reinterpret_cast<decltype(name)>(dlsym(lib, #name)); \
  if (!name) throw std::runtime_error("cuBLASLt: " + soname + " has no " #name);
    REMAT_CUBLASLT_FUNCTIONS(REMAT_LOAD)
#undef REMAT_LOAD
    check(cublasLtCreate(&handle), "cublasLtCreate");
  }
  void check(cublasStatus_t status, const char *what) const {
    if (status != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error(std::string("cuBLASLt: ") + what + ": " + cublasLtGetStatusString(status));
  }
};

CublasLt &cublaslt() {
  static CublasLt lt;
  return lt;
}

// A prepared GEMM: descriptors and the algorithm, made once per shape and kind.
struct Prepared {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t x = nullptr, y = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// Row-major out[m, n] = A B is column-major out^T[n, m] = B^T A^T: cuBLASLt's first operand X is
// B (as stored: [n, k] column-major is b[k, n] row-major; transposed when trans_b), its second Y
// is A likewise, and bias runs along out^T's rows (the n output features).
Prepared prepare(const GemmCall &g) {
  CublasLt &lt = cublaslt();
  Prepared p;
  const cudaDataType_t in = g.bf16_in ? CUDA_R_16BF : CUDA_R_32F, out = g.bf16_out ? CUDA_R_16BF : CUDA_R_32F;
  lt.check(lt.cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t op_x = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_y = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  lt.check(lt.cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_x, sizeof op_x), "TRANSA");
  lt.check(lt.cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_y, sizeof op_y), "TRANSB");
  if (g.bias) {  // the bias has the output's type; its pointer is set again for each call
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    lt.check(lt.cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue),
             "EPILOGUE");
    lt.check(lt.cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof g.bias),
             "BIAS_POINTER");
  }
  // column-major (rows, cols, leading dimension)
  lt.check(g.trans_b ? lt.cublasLtMatrixLayoutCreate(&p.x, in, g.k, g.n, g.k)
                     : lt.cublasLtMatrixLayoutCreate(&p.x, in, g.n, g.k, g.n),
           "layout of B");
  lt.check(g.trans_a ? lt.cublasLtMatrixLayoutCreate(&p.y, in, g.m, g.k, g.m)
                     : lt.cublasLtMatrixLayoutCreate(&p.y, in, g.k, g.m, g.k),
           "layout of A");
  lt.check(lt.cublasLtMatrixLayoutCreate(&p.d, out, g.n, g.m, g.n), "layout of out");
  cublasLtMatmulPreference_t pref = nullptr;
  lt.check(lt.cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const std::size_t workspace = 0;
  lt.check(lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                   sizeof workspace),
           "MAX_WORKSPACE_BYTES");
  // The algorithm must not depend on where a plan put the operands (each policy lays the arena
  // out differently, and another algorithm may give other bits): every operand is assumed to be
  // exactly gemm_alignment-byte aligned, and no split-K reduction is allowed (one summation order).
  const std::uint32_t bytes = gemm_alignment;
  for (auto attribute : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                         CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    lt.check(lt.cublasLtMatmulPreferenceSetAttribute(pref, attribute, &bytes, sizeof bytes), "MIN_ALIGNMENT");
  const std::uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
  lt.check(lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction,
                                                   sizeof reduction),
           "REDUCTION_SCHEME_MASK");
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  lt.check(lt.cublasLtMatmulAlgoGetHeuristic(lt.handle, p.desc, p.x, p.y, p.d, p.d, pref, 1, &result, &found),
           "cublasLtMatmulAlgoGetHeuristic");
  lt.cublasLtMatmulPreferenceDestroy(pref);
  if (found < 1) throw std::runtime_error("cuBLASLt: no algorithm without workspace and split-K");
  p.algo = result.algo;
  return p;
}

}  // namespace

void gemm(const GemmCall &g) try {
  require_gemm_alignment(g);
  using Key = std::tuple<int, int, int, bool, bool, bool, bool, bool>;
  static std::map<Key, Prepared> prepared;
  const Key key{g.m, g.n, g.k, g.trans_a, g.trans_b, g.bf16_in, g.bf16_out, g.bias != nullptr};
  auto it = prepared.find(key);
  if (it == prepared.end()) it = prepared.emplace(key, prepare(g)).first;
  Prepared &p = it->second;
  CublasLt &lt = cublaslt();
  if (g.bias)
    lt.check(lt.cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof g.bias),
             "BIAS_POINTER");
  const float alpha = 1.f, beta = g.accumulate ? 1.f : 0.f;
  lt.check(lt.cublasLtMatmul(lt.handle, p.desc, &alpha, g.b, p.x, g.a, p.y, &beta, g.out, p.d, g.out, p.d, &p.algo,
                             nullptr, 0, state.compute),
           "cublasLtMatmul");
} catch (const std::exception &e) { throw std::runtime_error(std::string(e.what()) + " (" + describe(g) + ")"); }

}  // namespace remat::cuda

#else  // built without the CUDA toolkit

namespace remat::cuda {
namespace {
[[noreturn]] void unavailable() {
  throw std::runtime_error("this build of remat has no CUDA support (the CUDA toolkit was not found)");
}
}  // namespace
DeviceInfo probe() { return {.error = "this build of remat has no CUDA support (the CUDA toolkit was not found)"}; }
void select_device(int) {}
int selected_device() { return 0; }
void init() { unavailable(); }
void *native_stream(Stream) { unavailable(); }
std::size_t device_used_bytes() { unavailable(); }
void *device_malloc(std::size_t) { unavailable(); }
void device_free(void *) {}
void *pinned_malloc(std::size_t) { unavailable(); }
void pinned_free(void *) {}
void copy_to_device(void *, const void *, std::size_t, Stream) { unavailable(); }
void copy_to_host(void *, const void *, std::size_t, Stream) { unavailable(); }
void synchronize(Stream) { unavailable(); }
Event event_create(bool) { unavailable(); }
void event_destroy(Event) {}
void record(Event, Stream) { unavailable(); }
void wait(Stream, Event) { unavailable(); }
void synchronize(Event) { unavailable(); }
bool done(Event) { unavailable(); }
float elapsed_ms(Event, Event) { unavailable(); }
void gemm(const GemmCall &) { unavailable(); }
}  // namespace remat::cuda

#endif
