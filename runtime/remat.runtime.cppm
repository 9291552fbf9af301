// module remat.runtime: runs a plan. One arena sized by the plan, an executor that walks the
// plan's steps calling generated Halide kernels, data sources and the shared trainer loop.
module;
#include <HalideRuntime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>
export module remat.runtime;
import remat;

export namespace remat::runtime {

// A generated kernel: its symbol, Halide's uniform entry point and its argument metadata.
struct Kernel {
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
};

// Bytes Halide kernels allocated themselves (through halide_malloc): now and at most.
struct HalideHeap {
  std::size_t current = 0, peak = 0;
};
HalideHeap halide_heap();
void reset_halide_heap_peak();

// The arena: one allocation of the plan's size. Unused bytes hold a canary pattern so the
// high-water mark actually written by kernels can be measured after the fact.
class Arena {
public:
  explicit Arena(std::size_t bytes);
  std::byte *data() const { return base.get(); }
  std::size_t size() const { return bytes; }
  void fill_canary();
  std::size_t high_water() const;  // one past the highest byte that no longer holds the canary

private:
  struct Free { void operator()(std::byte *p) const; };
  std::unique_ptr<std::byte, Free> base;
  std::size_t bytes;
};

// Binds every step of a plan to its kernel and arena buffers once; running a step then only
// calls the kernel (no allocation inside a training step).
class Executor {
public:
  Executor(const Plan &plan, std::string_view model_name, std::span<const Kernel> kernels,
           Arena &arena, Scalars &scalars);
  ~Executor();
  enum class Phase { train, optimize, eval };
  void run(Phase phase);
  int launches(Phase phase) const;
  template <class T> std::span<T> tensor(std::string_view name) const {
    auto [p, bytes] = locate(name);
    return {reinterpret_cast<T *>(p), bytes / sizeof(T)};
  }

private:
  std::pair<std::byte *, std::size_t> locate(std::string_view name) const;
  struct Bound;
  const Plan &plan;
  Arena &arena;
  std::vector<std::unique_ptr<Bound>> train_calls, optimize_calls, eval_calls;
};

// Fashion-MNIST style idx files (gzip or plain): images scaled to [0, 1], labels 0..classes-1.
struct Dataset {
  int rows = 0, width = 0;
  std::vector<float> images;
  std::vector<std::int32_t> labels;
};
Dataset load_idx(const std::string &images_path, const std::string &labels_path, int classes);

// What a trainer example passes to the shared trainer loop.
struct ModelInfo {
  std::string_view name;
  const Model &model;
  Policy default_policy;
  std::span<const Kernel> kernels;
  // Trainer defaults for this example (flags override them).
  int default_batch = 128;
  int default_epochs = 3;
  double default_learning_rate = 1e-3;
  int default_warmup_steps = 0;
};

// The trainer shared by every example: flags, data, training, evaluation, JSON summary.
int train_main(int argc, char **argv, const ModelInfo &info);

// Policy from its flag spelling: none | full | every_n_layers=N | sqrt_n.
Policy parse_policy(std::string_view text);

// FNV-1a over bytes, as 16 hex digits.
std::string digest(std::span<const std::byte> bytes);

}  // namespace remat::runtime
