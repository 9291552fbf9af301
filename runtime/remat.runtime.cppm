// module remat.runtime: runs a plan. One arena sized by the plan, an executor that walks the
// plan's steps calling generated Halide kernels, and the Engine that holds them with the
// parameter init. No CLI, report, file or data code (module remat.trainer has those): what
// another project links to run a model.
module;
#include <HalideRuntime.h>

#include "bf16.h"
#include "cuda_device.h"

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
export module remat.runtime;
import remat;

export namespace remat::runtime {

// A generated kernel: what it is (the executor finds it by that), its name (its symbol), Halide's
// uniform entry point and its argument metadata.
struct Kernel {
  KernelKey key;
  const char *name;
  int (*argv)(void **);
  const halide_filter_metadata_t *(*metadata)();
};

// A problem with the user's input (flags, files): reported as one line, exit code 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Scalar kernel arguments, bound by name. The executor points kernels at these fields, so the
// trainer changes them between steps without rebinding anything.
struct Scalars {
  bool accumulate = false;  // add to the gradients instead of overwriting them
  float grad_scale = 1.f;   // 1 / (rows per optimizer step)
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.f;
  float bias1 = 1.f, bias2 = 1.f;  // AdamW bias corrections 1 - beta^t
  // Dropout: the mask is a hash of (seed, step, rng_block, element); rng_block is per kernel
  // call (the executor binds it from the plan). Threshold 0 and scale 1 keep everything.
  std::uint64_t seed = 0, drop_threshold = 0;
  std::int32_t step = 0;
  float drop_scale = 1.f;
  // Dropout's row counter starts here: the micro-batch's first row within the step's global batch
  // ((micro-batch x ranks + rank) x rows), so N ranks draw the masks of one process.
  std::int32_t first_row = 0;
  void set_dropout(double p);  // p in [0, 1)
};

// Bytes Halide kernels allocated themselves (through halide_malloc): now and at most.
struct HalideHeap {
  std::size_t current = 0, peak = 0;
};
HalideHeap halide_heap();
void reset_halide_heap_peak();

// Every heap allocation (malloc, calloc, realloc, aligned allocations, operator new: any thread)
// made while the executor runs a phase, or while a CountedHeap lives (the trainer's gradient
// all-reduce), counted since the last reset (runtime/heap_hooks.cpp).
struct StepHeap {
  std::size_t allocations = 0, bytes = 0;
};
StepHeap step_heap();
void reset_step_heap();
struct CountedHeap {
  CountedHeap();
  ~CountedHeap();
  CountedHeap(const CountedHeap &) = delete;
  CountedHeap &operator=(const CountedHeap &) = delete;
};

// The variant of the CPU kernels this CPU runs: "avx512" where it has AVX-512 (the Skylake-server
// set), "avx2" otherwise or when REMAT_CPU_VARIANT=avx2 forces the baseline.
std::string_view cpu_kernel_variant();

// bfloat16 <-> float (round to nearest even, as the kernels round; runtime/bf16.h).
using remat::bf16_to_float;
using remat::float_to_bf16;

// opencl: the GPU schedules run through OpenCL from host memory (Halide copies each input to the
// device and the executor copies each output back), so tests check them on PoCL without a GPU.
enum class Device { cpu, cuda, opencl };

// The arena: one allocation of the plan's size, in host memory (CPU) or device memory (CUDA,
// one cudaMalloc; a host mirror of the same size holds what the trainer reads and writes, moved
// by upload/download), followed by a guard region that no plan uses. Unused bytes hold a canary
// pattern, so the high-water mark actually written by kernels is measured after the fact, and a
// write past the plan's end shows in the guard (the executor checks it after every kernel).
class Arena {
public:
  static constexpr std::size_t guard_bytes = 16384;
  explicit Arena(std::size_t bytes, Device device = Device::cpu);
  ~Arena();
  Arena(const Arena &) = delete;
  Arena &operator=(const Arena &) = delete;
  Device device() const { return where; }
  std::byte *data() const { return host; }  // the arena (CPU) or its host mirror (CUDA)
  std::byte *device_data() const { return dev ? dev : host; }
  std::size_t size() const { return bytes; }
  // CUDA: mirror -> device on the compute stream / device -> mirror after the queued kernels.
  // No-ops on the CPU.
  void upload(std::size_t offset, std::size_t n);
  void download(std::size_t offset, std::size_t n);
  void synchronize();  // CUDA: waits for the queued kernels
  void fill_canary();  // the whole arena and its guard
  bool canary_filled() const { return filled; }
  // Refills [offset, offset + n) of the host view (CPU, OpenCL) with the canary, keeping what
  // was written there in high_water().
  void release(std::size_t offset, std::size_t n);
  // One past the highest byte, guard included, that no longer holds the canary: above size()
  // when something wrote past the plan.
  std::size_t high_water();
  // The first byte of the guard that no longer holds the canary, as an offset past size(); or -1.
  long guard_damage();
  // The first byte in [offset, offset + n) of the host view that is not canary, or -1.
  long first_written(std::size_t offset, std::size_t n) const;

private:
  std::size_t bytes;
  Device where;
  bool filled = false;
  std::size_t released_high = 0;  // the high-water mark of released memory
  std::byte *host = nullptr, *dev = nullptr;
  void fill_canary(std::size_t offset, std::size_t n);
};

// What the executor checks around every kernel call, besides the arena's guard (checked after
// every kernel on the CPU; on CUDA after each phase, or after every kernel with REMAT_CUDA_SYNC=1,
// which also synchronizes after every kernel so that an asynchronous fault names its kernel; on
// OpenCL the host copies Halide brings back per buffer cannot show a device-side overrun).
struct ExecutorChecks {
  // After each kernel, every byte outside the tensors live at that step still holds the canary
  // (memory of freed tensors is refilled with it), and every byte of the live tensors that the
  // kernel does not write (parts of a flat buffer outside its written views included) is
  // unchanged: a kernel writing outside its own outputs is named. Host-visible arenas only (CPU; on OpenCL it sees the
  // host copies, which Halide fills from the device per buffer, so a device-side overrun is not seen); costs a copy and
  // a scan of the arena per kernel (tests). Needs an arena filled with the canary. REMAT_CHECK_ARENA=1 turns it on for
  // every such arena.
  bool free_memory = false;
};

// Binds every step of a plan to its kernel and arena buffers once; running a step then only
// calls the kernel (no allocation inside a training step). With an offload plan it also moves
// checkpoints to and from a pinned host buffer (CUDA: on a copy stream ordered by events; CPU:
// plain copies, used by the tests).
class Executor {
public:
  using Checks = ExecutorChecks;
  Executor(const Plan &plan, std::string_view model_name, std::span<const Kernel> kernels, Arena &arena,
           Scalars &scalars, Checks checks = {});
  ~Executor();
  enum class Phase { train, optimize, eval };
  void run(Phase phase);
  // The host view of a tensor of the plan whose elements are T (on CUDA, the arena's mirror:
  // download() before reading what kernels wrote, upload() after writing). Tensors are the plan's
  // handles: plan.params(), plan.row_loss(), plan.at(key)...
  template <class T>
  std::span<T> tensor(TensorId t) const {
    auto [offset, bytes] = locate(t, sizeof(T));
    return {reinterpret_cast<T *>(arena.data() + offset), bytes / sizeof(T)};
  }
  // Where kernels see a tensor of T: the arena's device memory (CUDA) or the host view.
  template <class T>
  T *device_tensor(TensorId t) const {
    return reinterpret_cast<T *>(arena.device_data() + locate(t, sizeof(T)).first);
  }
  // A floating-point tensor (fp32 or bf16) as floats, read from / written to the host view.
  std::vector<float> values(TensorId t) const;
  void set_values(TensorId t, std::span<const float> values);
  std::size_t element_size(TensorId t) const;
  void upload(TensorId t);
  void download(TensorId t);
  // With time_calls set (or REMAT_PROFILE), each call's seconds are summed over the runs: the
  // seconds of call i of a phase, and how many runs were timed (--calibrate).
  bool time_calls = false;
  std::vector<double> call_seconds(Phase phase) const;
  long timed_runs(Phase phase) const;
  // While set, called before each kernel call of run() (done = false: the step's tensors in
  // Step::alloc are about to become live) and after it (done = true: those in Step::free have
  // died), with the index of the step in the phase's list of the plan. Not counted as heap use of
  // the step (the trainer's --memory-timeline records a step through it).
  std::function<void(Phase phase, std::size_t step, bool done)> observe;
  // While set, called after each kernel call of the train phase with its step's index, as part of
  // the step (its heap use counted): data-parallel training hands the gradients a step finished
  // to its collectives (a communication thread, or NCCL's stream).
  std::function<void(std::size_t step)> finished;

  const Plan &plan;

private:
  // arena offset and bytes; elem_bytes (when not 0) must be the tensor's element size
  std::pair<std::size_t, std::size_t> locate(TensorId t, std::size_t elem_bytes = 0) const;
  struct Bound;
  struct Transfers;
  struct Untouched;
  void check_after(const Bound &b, const Step &step, std::vector<int> *live_roots, const Untouched &untouched);
  // A step's call: its kernel with the step's scalars and arena buffers, argument by argument.
  std::unique_ptr<Bound> bind(const Step &st, const Kernel &kernel, Scalars &scalars) const;
  void bind_buffer(Bound &b, int a, const halide_filter_argument_t &arg, const Arg &step_arg) const;
  void report_profile() const;  // with REMAT_PROFILE set (profile.cpp)
  void break_on_purpose();      // with REMAT_MUTATION set: tests/mutations.py's faults (mutation.cpp)
  Arena &arena;
  Checks checks;
  std::vector<std::unique_ptr<Bound>> train_calls, optimize_calls, eval_calls;
  std::unique_ptr<Transfers> transfers;
};

// What runs one plan: the plan, an arena sized for its training and evaluation peaks (filled
// with the canary pattern unless asked not to: a kernel reading memory nothing wrote then shows
// NaN), the kernels' scalars and the executor that walks the plan. The trainer, the sampler, the
// tests and the benchmarks run models through it.
class Engine {
public:
  struct Options {
    Device device = Device::cpu;
    bool canary = true;
    ExecutorChecks checks = {};
  };
  Engine(Plan plan, std::string_view model_name, std::span<const Kernel> kernels, Options options);
  Engine(Plan plan, std::string_view model_name, std::span<const Kernel> kernels)
      : Engine(std::move(plan), model_name, kernels, Options{}) {}
  void train() { executor.run(Executor::Phase::train); }        // one micro-batch: forward, loss, backward
  void optimize() { executor.run(Executor::Phase::optimize); }  // AdamW on the accumulated gradients
  void evaluate() { executor.run(Executor::Phase::eval); }      // forward-discard and the loss
  // Every parameter as its kind's Init says (uniform_fan_in: U(-1/sqrt(fan in), 1/sqrt(fan in))
  // from a 64-bit Mersenne Twister seeded with `seed`, in plan order; ones; zeros), gradients and
  // AdamW moments zero (the alignment padding between parameters too), uploaded.
  void init_params(std::uint64_t seed);

  const std::string model_name;
  const Plan plan;
  Arena arena;
  Scalars scalars;
  Executor executor;
};

// FNV-1a over bytes, as 16 hex digits.
std::string digest(std::span<const std::byte> bytes);

}  // namespace remat::runtime

// ---- Not exported: what the executor's files share (executor.cpp binds the plan's steps,
// executor_run.cpp runs them, offload.cpp moves checkpoints, profile.cpp reports) ----------------
namespace remat::runtime {

// One step's kernel call, bound once: the kernel, its argument vector (scalars, then halide
// buffers pointing into the arena) and what REMAT_PROFILE and --calibrate sum over the runs.
struct Executor::Bound {
  const Kernel *kernel;
  float no_weight_decay = 0;  // AdamW over parameters that are not decayed
  bool accumulates = true;    // a backward that adds to the gradients whatever the micro-batch does
  double seconds = 0;         // with REMAT_PROFILE set: time spent in this call
  long calls = 0;
  double flops = 0;       // the step's kernel_flops, per call
  std::size_t bytes = 0;  // bytes of the tensors it reads and writes, per call
  std::int32_t rng_block = 0;
  bool skipped = false;  // REMAT_MUTATION=skip_recompute: the kernel is not called
  std::vector<halide_buffer_t> buffers;
  std::vector<int> inputs, outputs;  // buffer arguments by kind (Device::opencl moves them)
  std::vector<std::array<halide_dimension_t, 2>> shapes;
  std::vector<void *> argv;
};

// Offload: checkpoints and named internals copied to the pinned host buffer and back, before the
// steps that say so (offload.cpp).
struct Executor::Transfers {
  Transfers(const Plan &plan, Arena &arena);
  ~Transfers();
  void before(const Step &st);  // the step's copies out and fetches into restored tensors
  std::byte *device_at(int t) const;
  const Plan &plan;
  Arena &arena;
  std::size_t bytes;
  bool cuda_device = false;
  std::byte *host = nullptr;
  std::map<int, cuda::Event> done;  // by tensor: its copy-out (offloaded) or fetch (restored)
  cuda::Event ready{};
};

}  // namespace remat::runtime
