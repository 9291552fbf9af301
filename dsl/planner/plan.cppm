// Partition remat.planner:plan: what a plan is. Its tensors (keyed, placed in the arena), its steps (kernel
// calls with their bound arguments, allocations, frees and transfers) and the handles of what a
// trainer reads and writes.
module;
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>
export module remat.planner:plan;
import remat.tensors;
import :policies;
import :strategy;

export namespace remat {

enum class Role : std::uint8_t {
  params,
  grads,
  adam_m,
  adam_v,       // flat, persistent; per-layer tensors are views into them
  data,         // batch inputs and labels, persistent
  block_input,  // a block's input kept for its backward (or the next block)
  internal,     // an internal saved for backward
  recomputed,   // an internal rebuilt or discarded within one kernel call
  gradient,     // gradient flowing between blocks
  scratch,      // short-lived workspace of one backward kernel
  metrics,      // per-row loss and correctness, persistent
  exchange,     // data-parallel: the receive buffer of the gradient all-reduce, persistent
};

// Tensors that hold values from outside the schedule (parameters, optimizer state, the batch,
// the metrics): live through every step; all others live from their alloc to their free.
constexpr bool persistent(Role r) {
  return r == Role::params || r == Role::grads || r == Role::adam_m || r == Role::adam_v || r == Role::data ||
         r == Role::metrics || r == Role::exchange;
}

constexpr bool is_activation(Role r) { return r == Role::block_input || r == Role::internal || r == Role::recomputed; }

struct Tensor {
  // What it is (placed at its block and phase; a segment replay's rebuilt copies have the keys of
  // the originals); name_of(key) names it.
  TensorKey key;
  Role role{};
  int dims = 1;
  std::array<long long, 2> extent{};
  int elem_bytes = 4;
  int view_of = -1;             // for views: the root tensor and the byte offset inside it
  std::size_t offset = 0;       // roots: arena offset; views: offset inside the root
  std::size_t host_offset = 0;  // offloaded tensors: offset in the pinned host buffer
  // What it holds, and for a saved internal the layer whose backward reads it.
  LocalTensor::Kind kind = LocalTensor::Kind::activation;
  int read_by = -1;
  Init init = Init::zeros;  // parameters: how the trainer starts them
  constexpr std::size_t bytes() const {
    long long n = elem_bytes;
    for (int d = 0; d < dims; ++d) n *= extent[d];
    return std::size_t(n);
  }
};

// A buffer argument of a kernel call, bound to a tensor of the plan (the executor binds by position).
struct Arg {
  int tensor;  // index into Plan::tensors
  Access access = Access::read;
  TensorKey key{};  // the kernel's argument (its signature's: x, h3, p2_w...), for reports and messages
};

// A tensor of a plan: the handle the runtime's tensor access takes (the plan's finders make them).
struct TensorId {
  int index = -1;
  constexpr bool valid() const { return index >= 0; }
  constexpr bool operator==(const TensorId &) const = default;
};

struct Step {
  int stage = -1;
  Variant variant{};
  int block = 0;             // index of the block within its stage
  int rng_block = 0;         // dropout counter key of this block (unique per block of the model)
  bool recompute = false;    // runs forward work a second time
  bool weight_decay = true;  // adamw: whether this range of parameters is decayed
  bool accumulates = false;  // backward: adds to the parameter gradients even when the micro-batch does not
  double flops = 0;          // kernel_flops of this call
  // The kernel's arguments in its signature's order: its scalars (values the executor supplies),
  // then its buffers (those it reads, then those it writes).
  std::vector<Scalar> scalars;
  std::vector<Arg> args;
  std::vector<int> alloc;  // tensors that become live before the kernel runs
  std::vector<int> free;   // tensors that die after it
  // Offload (checkpoints, named internals): transfers between arena tensors and the pinned host
  // buffer, on a copy stream ordered by events. Before the kernel: wait for the copy-out of
  // `await_out` (their memory is about to be reused), start copying each `offload` tensor out
  // (written by an earlier step; it dies after this one), start bringing back each `fetch` pair
  // {host copy of tensor a, into tensor b} (b is in `alloc`), and wait for the arrival of
  // `await_in`.
  std::vector<int> await_out, await_in, offload;
  std::vector<std::pair<int, int>> fetch;
};

struct Plan {
  Policy policy{};           // the policy asked for (a per-stage choice: its first repeat stage's)
  StagePolicies policies{};  // each stage's
  Message policy_label{};    // policies_name
  Strategy strategy{};       // what every block does (lower(policies), or the budget's solution)
  Precision precision{};
  int batch = 0;       // samples per micro-batch
  long long rows = 0;  // rows per micro-batch: samples x rows per sample
  std::vector<Tensor> tensors;
  std::vector<Step> train;           // one micro-batch: forward, loss, backward
  std::vector<Step> optimize;        // AdamW over the flat parameters
  std::vector<Step> eval;            // forward-discard of every stage, then the loss kernel
  std::size_t peak_bytes = 0;        // arena size: the highest byte any live tensor reaches
  std::size_t activation_bytes = 0;  // most activation bytes live at once during training
  std::size_t eval_peak_bytes = 0;
  std::size_t offload_bytes = 0;  // pinned host buffer for offloaded checkpoints
  long long param_count = 0;      // parameters (the flat buffers also hold alignment padding)
  // The flat parameter slots whose AdamW moments this plan keeps and updates: all of them, or with
  // StagePolicies::shard_optimizer rank r's [r S, (r + 1) S) of ranks x S (S a whole number of
  // arena_alignment); the moments' buffers hold S slots.
  long long shard_first = 0, shard_slots = 0, shard_end = 0;
  int recompute_launches = 0;  // kernels per micro-batch that recompute forward work
  int total_launches = 0;

  // The first tensor with this key (a segment replay's rebuilt copies share their original's), or none.
  constexpr TensorId find(const TensorKey &k) const {
    for (int i = 0; i < int(tensors.size()); ++i)
      if (tensors[i].key == k) return {i};
    return {};
  }
  // ... one the plan must have.
  constexpr TensorId at(const TensorKey &k) const {
    const TensorId t = find(k);
    if (!t.valid()) throw "remat planner: the plan has no tensor of this key";
    return t;
  }
  // What a trainer reads and writes: the flat parameters, gradients and AdamW moments (each
  // layer's are views into them: at(key::parameter(block, layer, i).at(stage, block_index))), the
  // batch, the per-row metrics, a block's output and the logits of a phase.
  constexpr TensorId params() const { return at(key::of(Slot::params)); }
  constexpr TensorId grads() const { return at(key::of(Slot::grads)); }
  constexpr TensorId adam_m() const { return at(key::of(Slot::adam_m)); }
  constexpr TensorId adam_v() const { return at(key::of(Slot::adam_v)); }
  constexpr TensorId inputs() const { return at(key::of(Slot::inputs)); }
  constexpr TensorId labels() const { return at(key::of(Slot::labels)); }
  constexpr TensorId row_loss() const { return at(key::of(Slot::row_loss)); }
  constexpr TensorId row_correct() const { return at(key::of(Slot::row_correct)); }
  constexpr TensorId block_output(int stage, int block, Phase phase) const {
    return at(key::block_output().at(stage, block, phase));
  }
  // The logits the loss kernel of the phase reads (the last block's output).
  constexpr TensorId logits(Phase phase) const {
    for (const Step &st : phase == Phase::train ? train : eval)
      if (st.variant == Variant::loss) return {st.args[0].tensor};
    throw "remat planner: the plan has no loss step";
  }
  // Where tensor t starts in the arena (a view: its root's offset plus its own).
  constexpr std::size_t arena_offset(int t) const {
    const Tensor &x = tensors[t];
    return x.offset + (x.view_of >= 0 ? tensors[x.view_of].offset : 0);
  }
};

// Data-parallel: the flat gradient slots [first, end) of chunk c (of plan.policies.ranks) of
// gradient tensor t (a view of the flat gradients) that the ring exchanges: 1 / ranks of it, or
// with a sharded optimizer its part in rank c's shard (maybe none).
constexpr std::pair<long long, long long> gradient_chunk(const Plan &plan, const Tensor &t, int c) {
  const long long first = (long long)t.offset / 4, n = (long long)t.bytes() / 4, ranks = plan.policies.ranks;
  if (!plan.policies.shard_optimizer) return {first + n * c / ranks, first + n * (c + 1) / ranks};
  return {std::clamp(plan.shard_slots * c, first, first + n), std::clamp(plan.shard_slots * (c + 1), first, first + n)};
}

// Arena offsets and sizes are multiples of arena_alignment.
constexpr std::size_t align_up(std::size_t v) { return (v + arena_alignment - 1) / arena_alignment * arena_alignment; }

}  // namespace remat
