// module remat.planner: lowers (model, policy, batch, precision) to a schedule of kernel calls and
// a first-fit arena layout (make_plan), binding every argument of every kernel's signature.
module;
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <tuple>
#include <vector>
export module remat.planner;
export import remat.tensors;

export namespace remat {

// A segment [first, last] of consecutive blocks that keeps only the input of `first`; backward
// rebuilds the segment's internals from it. Blocks outside every segment keep their internals.
struct Segment {
  int first, last;
};

constexpr int ceil_sqrt(int n) {
  int r = 0;
  while (r * r < n) ++r;
  return r;
}

constexpr std::vector<Segment> segments(Policy p, int n_blocks) {
  std::vector<Segment> out;
  if (n_blocks <= 0) return out;
  switch (p.kind) {
  case Policy::Kind::none:
  case Policy::Kind::budget: break;
  case Policy::Kind::full:
    for (int i = 0; i < n_blocks; ++i) out.push_back({i, i});
    break;
  case Policy::Kind::every_n_layers:
    for (int i = 0; i < n_blocks; i += p.n) out.push_back({i, i});
    break;
  case Policy::Kind::sqrt_n: {
    // ceil(sqrt(L)) parts of equal length (Chen et al. 2016), all but the last recomputed. The last
    // keeps its internals, as torch.utils.checkpoint.checkpoint_sequential's does: its backward
    // comes first, while only the earlier parts' inputs are kept, so the peak is the one a
    // recomputed part reaches anyway (give or take a block's internals).
    const int count = ceil_sqrt(n_blocks), length = (n_blocks + count - 1) / count;
    for (int i = 0; i + length < n_blocks; i += length) out.push_back({i, i + length - 1});
    break;
  }
  }
  return out;
}

// The policy of each stage (index = stage; loose stages ignore theirs). A single Policy converts
// to one for every stage: the trainer's --checkpoint-policy P.
struct StagePolicies {
  std::array<Policy, max_stages> stage{};
  constexpr StagePolicies() = default;
  constexpr StagePolicies(const Policy &p) {  // NOLINT: implicit on purpose
    for (Policy &s : stage) s = p;
  }
  constexpr bool operator==(const StagePolicies &) const = default;
};

// The model's own: each annotated repeat stage's policy, `fallback` (the model module's default)
// for the others.
constexpr StagePolicies annotated(const Model &m, const Policy &fallback) {
  StagePolicies out(fallback);
  for (int s = 0; s < m.n_stages; ++s)
    if (m.stages[s].annotated) out.stage[s] = m.stages[s].policy;
  return out;
}

// The budget policy among the stages' (every repeat stage must then have the same), or none.
constexpr const Policy *budget_of(const Model &m, const StagePolicies &ps) {
  const Policy *found = nullptr;
  for (int s = 0; s < m.n_stages; ++s)
    if (m.stages[s].checkpointable && ps.stage[s].kind == Policy::Kind::budget) found = &ps.stage[s];
  if (found)
    for (int s = 0; s < m.n_stages; ++s)
      if (m.stages[s].checkpointable && !(ps.stage[s] == *found))
        throw "remat planner: a memory budget is the whole model's policy; a stage cannot have another";
  return found;
}

// "selective", or per stage "s1:selective,s3:every_n_layers=2" when the repeat stages differ.
constexpr Message policies_name(const Model &m, const StagePolicies &ps) {
  int first = -1;
  bool same = true;
  for (int s = 0; s < m.n_stages; ++s)
    if (m.stages[s].checkpointable) {
      if (first < 0)
        first = s;
      else
        same = same && ps.stage[s] == ps.stage[first];
    }
  if (first < 0) return policy_name(ps.stage[0]);
  if (same) return policy_name(ps.stage[first]);
  Message out;
  for (int s = 0; s < m.n_stages; ++s)
    if (m.stages[s].checkpointable)
      out.append(out.size() ? "," : "").append("s").append(s).append(":").append(policy_name(ps.stage[s]));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Strategies: how the chain runs (the operations of rotor, Beaumont et al. 2019, "Optimal
// checkpointing for heterogeneous chains"). The chain is every block of every stage in order
// (units 0..n-1), then the loss (unit n). Sub-problem (s, t) runs the backward of units s..t
// given the input of s (kept by its caller) and the gradient of t's output (for t = n the loss
// makes it), and ends with the gradient of s's input; it frees the input of s.
// ---------------------------------------------------------------------------------------------
struct Decision {
  enum class Op : std::uint8_t {
    keep,        // forward s keeping internals (`keep`: all or selective); solve (s+1, t); backward s
    checkpoint,  // forward s..until-1 keeping only the input of `until` (a checkpoint); solve
                 // (until, t); then solve (s, until-1) again from the input of s
    recompute,   // s == t: backward s with its whole forward fused in, from its input
    loss,        // s == t == n
    unset,
  } op = Op::unset;
  Keep keep = Keep::all;
  int until = 0;
  bool offload = false;  // checkpoint: the input of s waits in pinned host memory meanwhile
  constexpr bool operator==(const Decision &) const = default;
};

struct Strategy {
  int n = 0;                    // units before the loss
  std::vector<Decision> table;  // sub-problem (s, t) at s * (n + 1) + t
  constexpr explicit Strategy(int units = 0) : n(units) {
    table.reserve(std::size_t((n + 1) * (n + 1)));
    for (int i = 0; i < (n + 1) * (n + 1); ++i) table.push_back({});
  }
  constexpr Decision &at(int s, int t) { return table[std::size_t(s * (n + 1) + t)]; }
  constexpr const Decision &at(int s, int t) const { return table[std::size_t(s * (n + 1) + t)]; }
  constexpr bool operator==(const Strategy &) const = default;
};

// One unit of the chain: stage, block within it, whether its stage is a repeat stage.
struct Unit {
  int stage, block, index, rng;
};
constexpr std::vector<Unit> units_of(const Model &m) {
  std::vector<Unit> units;
  int index = 0;  // counts the blocks of repeat stages (-1 for the others)
  for (int s = 0; s < m.n_stages; ++s)
    for (int b = 0; b < m.stages[s].repeat; ++b)
      units.push_back({s, b, m.stages[s].checkpointable ? index++ : -1, int(units.size()) * 64});
  return units;
}

// The kernels the model compiler makes for a stage: every variant for repeat stages; forward_save,
// forward_discard and backward_saved for loose ones (generators/modelc.cpp, StageKernels).
constexpr bool has_kernel(const Model &m, int stage, Variant v) {
  if (m.stages[stage].checkpointable) return true;
  return v == Variant::forward_save || v == Variant::forward_discard || v == Variant::backward_saved;
}

// The strategy of the fixed policies: segments() of each repeat stage, whose first block's input
// is a checkpoint and whose other blocks are rebuilt (keeping everything) before their backward;
// blocks outside segments keep their internals (selectively under a selective policy).
constexpr Strategy lower(const Model &m, const StagePolicies &ps) {
  const std::vector<Unit> units = units_of(m);
  const int n = int(units.size());
  Strategy st(n);
  st.at(n, n).op = Decision::Op::loss;
  std::vector<Segment> segs;
  for (int s = 0, first = 0; s < m.n_stages; first += m.stages[s].repeat, ++s)
    if (m.stages[s].checkpointable)
      for (Segment g : segments(ps.stage[s], m.stages[s].repeat)) segs.push_back({first + g.first, first + g.last});
  std::vector<int> in_segment;
  for (int u = 0; u < n; ++u) in_segment.push_back(-1);
  for (int k = 0; k < int(segs.size()); ++k)
    for (int u = segs[k].first; u <= segs[k].last; ++u) in_segment[u] = k;
  for (int u = 0; u < n; ++u) {
    const Policy &p = ps.stage[units[u].stage];
    if (in_segment[u] < 0) {
      st.at(u, n) = {Decision::Op::keep, p.selective && units[u].index >= 0 ? Keep::selective : Keep::all};
      continue;
    }
    const Segment g = segs[in_segment[u]];
    if (g.first != u) continue;
    st.at(u, n) = {Decision::Op::checkpoint, Keep::all, g.last + 1, p.offload && u > 0};
    for (int r = g.first; r < g.last; ++r) st.at(r, g.last) = {Decision::Op::keep, Keep::all};
    st.at(g.last, g.last).op = Decision::Op::recompute;
  }
  return st;
}

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
};

// Tensors that hold values from outside the schedule (parameters, optimizer state, the batch,
// the metrics): live through every step; all others live from their alloc to their free.
constexpr bool persistent(Role r) {
  return r == Role::params || r == Role::grads || r == Role::adam_m || r == Role::adam_v || r == Role::data ||
         r == Role::metrics;
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

inline constexpr std::size_t arena_alignment = 64;

struct Plan {
  Policy policy{};           // the policy asked for (a per-stage choice: its first repeat stage's)
  StagePolicies policies{};  // each stage's
  Message policy_label{};    // policies_name
  Strategy strategy{};       // what every block does (lower(policies), or the budget's solution)
  Precision precision{};
  Gemms gemms{};
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
  int recompute_launches = 0;     // kernels per micro-batch that recompute forward work
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

// Arena offsets and sizes are multiples of arena_alignment.
constexpr std::size_t align_up(std::size_t v) { return (v + arena_alignment - 1) / arena_alignment * arena_alignment; }

}  // namespace remat

// Not exported: the planner's machinery.
namespace remat::detail {

// std::vector<int>(n, v) is not usable in constant expressions with libstdc++ 12 under clang.
constexpr std::vector<int> filled(std::size_t n, int value) {
  std::vector<int> v;
  v.reserve(n);
  for (std::size_t i = 0; i < n; ++i) v.push_back(value);
  return v;
}

// First-fit placement of tensors as the schedule makes them live and lets them die.
struct Placer {
  std::vector<Tensor> &tensors;
  std::vector<int> live{};
  std::size_t peak = 0;

  constexpr void alloc(int t) {
    std::vector<int> order = live;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return tensors[a].offset < tensors[b].offset; });
    std::size_t at = 0;
    const std::size_t need = tensors[t].bytes();
    for (int o : order) {
      if (tensors[o].offset >= at + need) break;
      at = std::max(at, align_up(tensors[o].offset + tensors[o].bytes()));
    }
    tensors[t].offset = at;
    live.push_back(t);
    peak = std::max(peak, at + need);
  }
  constexpr void release(int t) { std::erase(live, t); }
};

struct Builder {
  const Model &m;
  StagePolicies policies;
  Strategy strategy;
  int batch;
  Precision precision;
  Gemms gemms;
  long long n_rows = 0;
  Plan plan{};

  constexpr int add(Tensor t) {
    plan.tensors.push_back(t);
    return int(plan.tensors.size()) - 1;
  }
  Phase phase = Phase::train;  // of the tensors being made
  constexpr int local(int stage, int block, Role role, const LocalTensor &lt, int read_by = -1) {
    Tensor t{lt.key.at(stage, block, phase), role, lt.dims};
    t.elem_bytes = element_bytes(lt, precision);
    for (int d = 0; d < lt.dims; ++d) t.extent[d] = lt.extent[d] < 0 ? n_rows : lt.extent[d];
    t.kind = lt.kind;
    t.read_by = read_by;
    t.init = lt.init;
    return add(t);
  }
  constexpr int local(const Step &st, Role role, const KernelArg &a) {
    return local(st.stage, st.block, role, a.tensor, a.read_by);
  }
  // A tensor that comes to life for the step (and, if temporary, dies after it).
  static constexpr int live(Step &st, int t, bool temporary = false) {
    st.alloc.push_back(t);
    if (temporary) st.free.push_back(t);
    return t;
  }
  // The step's arguments, in its kernel's signature order: scalars recorded, each buffer bound to
  // the tensor bind(arg) returns.
  template <class Bind>
  constexpr void bind(Step &st, Bind bind) {
    for (const KernelArg &a : signature(m, st.stage, st.variant, precision, gemms)) {
      if (a.is_scalar()) {
        st.scalars.push_back(a.scalar);
        continue;
      }
      const int t = bind(a);
      if (t < 0) throw "remat planner: a kernel argument the planner cannot bind";
      st.args.push_back({t, a.access, a.tensor.key});
    }
  }
  constexpr void free_activation(Step &st, int t) const {  // data tensors stay
    if (plan.tensors[t].role != Role::data) st.free.push_back(t);
  }

  // Per (stage, block): tensor ids of parameters (views into the flat buffer), in the order of
  // params(block); their gradients are the same keys' gradients.
  std::vector<std::vector<std::vector<int>>> param_args{}, grad_args{};
  // The parameter (or the gradient) of unit u that kernel argument `k` (a parameter or a gradient
  // key, either side of an accumulation) names.
  constexpr int parameter_of(const Unit &u, const TensorKey &k) const {
    const bool gradient = k.slot == Slot::gradient || k.slot == Slot::gradient_prev;
    const std::vector<int> &ids = param_args[u.stage][u.block];
    for (std::size_t i = 0; i < ids.size(); ++i) {
      TensorKey p = plan.tensors[ids[i]].key.local();
      if (gradient) p = key::gradient(p, k.slot == Slot::gradient_prev);
      if (p == k) return gradient ? grad_args[u.stage][u.block][i] : ids[i];
    }
    return -1;
  }
  int params_root = -1, grads_root = -1, m_root = -1, v_root = -1;
  long long decayed_slots = 0;  // floats of the decayed range, padding included
  static constexpr long long slot_alignment = arena_alignment / 4;

  constexpr void make_params() {
    params_root = add({key::of(Slot::params), Role::params, 1});
    grads_root = add({key::of(Slot::grads), Role::grads, 1});
    m_root = add({key::of(Slot::adam_m), Role::adam_m, 1});
    v_root = add({key::of(Slot::adam_v), Role::adam_v, 1});
    param_args.resize(m.n_stages);
    grad_args.resize(m.n_stages);
    for (int s = 0; s < m.n_stages; ++s) {
      const std::size_t n = params(m.stages[s]).size();
      for (int b = 0; b < m.stages[s].repeat; ++b) {
        param_args[s].push_back(filled(n, -1));
        grad_args[s].push_back(filled(n, -1));
      }
    }
    // Two passes: decayed parameters (linear weights) first, so AdamW runs on two flat ranges.
    // Each parameter starts on an arena_alignment boundary (GEMM libraries want aligned operands,
    // and an alignment that is the same under every policy); the padding floats stay zero.
    long long count = 0, slots = 0;
    for (bool decayed : {true, false}) {
      for (int s = 0; s < m.n_stages; ++s)
        for (int b = 0; b < m.stages[s].repeat; ++b)
          for (int i = 0; const LocalTensor &lt : params(m.stages[s])) {
            if (lt.decay != decayed) {
              ++i;
              continue;
            }
            const int p = local(s, b, Role::params, lt);
            slots = (slots + slot_alignment - 1) / slot_alignment * slot_alignment;
            plan.tensors[p].view_of = params_root;
            plan.tensors[p].offset = std::size_t(slots) * 4;
            Tensor g = plan.tensors[p];
            g.key = key::gradient(g.key);
            g.role = Role::grads;
            g.view_of = grads_root;
            param_args[s][b][i] = p;
            grad_args[s][b][i++] = add(g);
            count += lt.elements(n_rows);
            slots += lt.elements(n_rows);
          }
      slots = (slots + slot_alignment - 1) / slot_alignment * slot_alignment;
      if (decayed) decayed_slots = slots;
    }
    plan.param_count = count;
    for (int r : {params_root, grads_root, m_root, v_root}) plan.tensors[r].extent[0] = slots;
  }

  constexpr Step step(int stage, Variant v, int block, int rng_block) const {
    Step st;
    st.stage = stage;
    st.variant = v;
    st.block = block;
    st.rng_block = rng_block;
    if (stage >= 0) st.flops = kernel_flops(m.stages[stage], v, n_rows);
    return st;
  }

  // Forward of one block. Returns the output tensor; the kept internals go to *kept with `role`.
  constexpr int forward(std::vector<Step> &out, const Unit &u, int x, Keep keep, Role role, std::vector<int> *kept) {
    Step st = step(u.stage, forward_variant(keep), u.block, u.rng);
    int y = -1;
    bind(st, [&](const KernelArg &a) {
      switch (a.role) {
      case ArgRole::block_input: return x;
      case ArgRole::parameter: return parameter_of(u, a.tensor.key);
      case ArgRole::block_output: return y = live(st, local(st, Role::block_input, a));
      case ArgRole::saved: {
        const int t = live(st, local(st, role, a));
        if (kept) kept->push_back(t);
        return t;
      }
      case ArgRole::scratch: return live(st, local(st, Role::recomputed, a), true);
      case ArgRole::workspace: return live(st, local(st, Role::scratch, a), true);
      default: return -1;
      }
    });
    out.push_back(st);
    return y;
  }

  // Backward of one block: consumes dy, produces dx (unless it is the model's first stage).
  // `kept`: what its forward saved, in the order of the signature's saved arguments.
  constexpr int backward(std::vector<Step> &out, const Unit &u, int x, int dy, const std::vector<int> &kept,
                         Keep keep) {
    Step st = step(u.stage, backward_variant(keep), u.block, u.rng);
    st.recompute = keep != Keep::all;
    int dx = -1, n_saved = 0;
    bind(st, [&](const KernelArg &a) {
      switch (a.role) {
      case ArgRole::block_input: return x;
      case ArgRole::output_grad: return dy;
      case ArgRole::parameter: return parameter_of(u, a.tensor.key);
      // written, and read back when accumulating (in place)
      case ArgRole::gradient: return parameter_of(u, a.tensor.key);
      case ArgRole::input_grad: return dx = live(st, local(st, Role::gradient, a));
      case ArgRole::saved: {
        const auto it = std::ranges::find_if(kept, [&](int t) { return plan.tensors[t].key.local() == a.tensor.key; });
        if (it == kept.end()) return -1;
        ++n_saved;
        const int t = bring_back(*it);
        st.free.push_back(t);
        return t;
      }
      case ArgRole::scratch: return live(st, local(st, Role::recomputed, a), true);
      case ArgRole::workspace: return live(st, local(st, Role::scratch, a), true);
      default: return -1;
      }
    });
    if (n_saved != int(kept.size())) throw "remat planner: a backward reads other tensors than its forward saved";
    st.free.push_back(dy);
    out.push_back(st);
    return dx;
  }

  // The loss kernel on the logits x: writes the logits' gradient (a new tensor) and the metrics.
  constexpr Step loss_step(int x, int labels, bool keep_dlogits) {
    Step st = step(-1, Variant::loss, 0, 0);
    bind(st, [&](const KernelArg &a) {
      switch (a.role) {
      case ArgRole::block_input: return x;
      case ArgRole::labels: return labels;
      case ArgRole::metric: return plan.at(a.tensor.key).index;
      case ArgRole::input_grad: {
        TensorKey k = a.tensor.key;
        k.phase = phase;
        const int dlogits = add({k, Role::gradient, 2, {m.classes(), n_rows}, element_bytes(a.element)});
        return live(st, dlogits, !keep_dlogits);
      }
      default: return -1;
      }
    });
    st.free.insert(st.free.begin(), x);
    return st;
  }

  // ---- offload ----
  // A tensor x (a checkpoint, or an internal its stage's policy names for offload) is copied out
  // before the kernel of step `at` (a checkpoint: the forward that reads it; an internal: the step
  // after the forward that made it), so that the copy overlaps that step; x dies after it, and
  // the next step waits for the copy before anything can reuse the memory.
  std::vector<std::pair<int, int>> offloaded{};  // {tensor, step at}
  constexpr void offload(int x, int at) { offloaded.push_back({x, at}); }
  // Called when the schedule reaches the step that reads x next (about to be pushed): a restored
  // copy is allocated one step earlier (the fetch overlaps that step) and awaited by the reader.
  // Where no step would lie between x's death and the restored copy's allocation, offloading
  // would save nothing: x stays in the arena and is returned itself.
  std::vector<std::pair<int, int>> restored{};  // {restored tensor, original}
  constexpr int bring_back(int x) {
    const auto it = std::find_if(offloaded.begin(), offloaded.end(), [&](auto o) { return o.first == x; });
    if (it == offloaded.end()) return x;
    if (int(plan.train.size()) < it->second + 3) {
      offloaded.erase(it);
      return x;
    }
    const int r = add(plan.tensors[x]);
    restored.push_back({r, original(x)});
    return r;
  }
  // The tensor whose host copy a restored copy came from (itself for others).
  constexpr int original(int x) const {
    for (auto [r, from] : restored)
      if (r == x) return from;
    return x;
  }
  // Offloads the internals of a forward that keeps them selectively and whose stage's policy names
  // them for offload (save_and_offload_only_these_names).
  constexpr void offload_named(const Unit &u, Keep keep, const std::vector<int> &kept) {
    if (keep != Keep::selective) return;
    const Selection &named = policies.stage[u.stage].selection;
    for (int t : kept) {  // the named layer's output; its row statistics (small) stay
      const Tensor &x = plan.tensors[t];
      if (x.key.layer >= 0 && x.kind == LocalTensor::Kind::activation &&
          named.offloads_tag(m.stages[u.stage].layers[x.key.layer].tag))
        offload(t, int(plan.train.size()));
    }
  }
  // After the schedule is built: place the frees, waits and fetches described above, and the
  // host copies in the pinned buffer.
  constexpr void schedule_transfers() {
    auto &train = plan.train;
    for (auto [x, at] : offloaded) {
      train[at].free.push_back(x);
      // a restored copy offloaded again (a nested checkpoint): the host still holds the original
      if (original(x) != x) continue;
      train[at].offload.push_back(x);
      if (at + 1 < int(train.size())) train[at + 1].await_out.push_back(x);
      plan.tensors[x].host_offset = plan.offload_bytes;
      plan.offload_bytes += align_up(plan.tensors[x].bytes());
    }
    for (auto [r, x] : restored) {
      int reader = -1;
      for (int i = 0; i < int(train.size()) && reader < 0; ++i)
        for (const Arg &a : train[i].args)
          if (a.tensor == r) reader = i;
      const int fetch_at = std::max(reader - 1, 0);
      train[fetch_at].alloc.insert(train[fetch_at].alloc.begin(), r);
      train[fetch_at].fetch.push_back({x, r});
      train[reader].await_in.push_back(r);
    }
  }

  std::vector<Unit> units{};
  int labels = -1;

  constexpr void check_kernel(const Unit &u, Variant v) const {
    if (!has_kernel(m, u.stage, v)) throw "remat planner: the strategy asks for a kernel a loose stage does not have";
  }
  // A forward the strategy runs again (inside a rebuild) is a recompute; its output and kept
  // internals are rebuilt copies.
  constexpr int forward_call(const Unit &u, int x, Keep keep, bool again, std::vector<int> *kept) {
    check_kernel(u, forward_variant(keep));
    const int y = forward(plan.train, u, x, keep, again ? Role::recomputed : Role::internal, kept);
    if (again) {
      plan.train.back().recompute = true;
      plan.tensors[y].role = Role::recomputed;
    }
    return y;
  }
  // Sub-problem (s, t): x is the input of unit s, dy the gradient of t's output (t < n). Returns
  // the gradient of s's input (-1: none).
  constexpr int solve(int s, int t, int x, int dy, bool again) {
    const Decision d = strategy.at(s, t);
    auto &train = plan.train;
    switch (d.op) {
    case Decision::Op::loss:
      train.push_back(loss_step(x, labels, true));
      return train.back().alloc[0];  // the logits' gradient
    case Decision::Op::recompute: {
      check_kernel(units[s], Variant::backward_recompute);
      const int dx = backward(train, units[s], x, dy, {}, Keep::nothing);
      free_activation(train.back(), x);
      return dx;
    }
    case Decision::Op::keep: {
      std::vector<int> kept;
      const int y = forward_call(units[s], x, d.keep, again, &kept);
      offload_named(units[s], d.keep, kept);
      int dy_s = dy;
      if (s < t)
        dy_s = solve(s + 1, t, y, dy, again);
      else
        train.back().free.push_back(y);  // the gradient of its output is given: y has no reader
      check_kernel(units[s], backward_variant(d.keep));
      const int dx = backward(train, units[s], x, dy_s, kept, d.keep);
      free_activation(train.back(), x);
      return dx;
    }
    case Decision::Op::checkpoint: {
      if (d.until <= s || d.until > t) throw "remat planner: a checkpoint outside its sub-problem";
      int z = x;
      for (int j = s; j < d.until; ++j) {
        const int y = forward_call(units[j], z, Keep::nothing, again, nullptr);
        if (j > s)
          free_activation(train.back(), z);
        else if (d.offload && plan.tensors[x].role != Role::data)
          offload(x, int(train.size()) - 1);
        z = y;
      }
      const int d_until = solve(d.until, t, z, dy, again);
      return solve(s, d.until - 1, bring_back(x), d_until, true);
    }
    case Decision::Op::unset: break;
    }
    throw "remat planner: the strategy leaves a sub-problem undecided";
  }

  int inputs = -1;
  // The persistent tensors: parameters, their gradients and moments, the batch, the metrics.
  constexpr void setup() {
    n_rows = (long long)batch * m.rows_per_sample();
    make_params();
    const TensorKey in = key::of(Slot::inputs);
    inputs = m.token_input()
                 ? add({in, Role::data, 1, {n_rows, 0}})
                 : add({in, Role::data, 2, {m.input.width, n_rows}, element_bytes(rows(in, m.input.width), precision)});
    labels = add({key::of(Slot::labels), Role::data, 1, {n_rows, 0}});
    for (Slot metric : {Slot::row_loss, Slot::row_correct, Slot::row_max, Slot::row_lse})
      add({key::of(metric), Role::metrics, 1, {n_rows, 0}});
    units = units_of(m);
  }
  constexpr std::size_t persistent_bytes() const {
    std::size_t n = 0;
    for (const Tensor &t : plan.tensors)
      if (t.view_of < 0 && persistent(t.role)) n += align_up(t.bytes());
    return n;
  }

  constexpr void build() {
    setup();
    plan.policies = policies;
    plan.strategy = strategy;
    plan.precision = precision;
    plan.gemms = gemms;
    plan.batch = batch;
    plan.rows = n_rows;
    // ---- forward, loss, backward: the strategy's sub-problem (0, n) ----
    const int dx = solve(0, int(units.size()), inputs, -1, false);
    // the model input's gradient (a repeat stage first: its blocks pass input gradients on) has
    // no reader: it dies with the step that wrote it
    if (dx >= 0) plan.train.back().free.push_back(dx);
    // ---- optimizer: decayed parameters, then the rest ----
    for (bool decayed : {true, false}) {
      const long long begin = decayed ? 0 : decayed_slots;
      const long long end = decayed ? decayed_slots : plan.tensors[params_root].extent[0];
      if (begin == end) continue;
      Step st = step(-1, Variant::adamw, decayed ? 0 : 1, 0);
      st.weight_decay = decayed;
      std::vector<std::pair<Slot, int>> views;  // p, g, m, v over [begin, end); m, v read and written in place
      for (auto [slot, root] : {std::pair{Slot::adamw_param, params_root},
                                {Slot::adamw_grad, grads_root},
                                {Slot::adamw_m, m_root},
                                {Slot::adamw_v, v_root}}) {
        Tensor view{key::adamw(slot, decayed ? 0 : 1), plan.tensors[root].role, 1, {end - begin, 0}};
        view.view_of = root;
        view.offset = std::size_t(begin) * 4;
        views.push_back({slot, add(view)});
      }
      bind(st, [&](const KernelArg &a) {
        for (auto [slot, view] : views)
          if (slot == a.tensor.key.slot) return view;
        return -1;
      });
      plan.optimize.push_back(st);
    }
    // ---- evaluation: forward-discard of every block, then the loss kernel ----
    phase = Phase::eval;
    int x = inputs;
    for (const Unit &unit : units) {
      const int y = forward(plan.eval, unit, x, Keep::nothing, Role::internal, nullptr);
      free_activation(plan.eval.back(), x);
      x = y;
    }
    plan.eval.push_back(loss_step(x, labels, false));

    schedule_transfers();
    place();
  }

  constexpr void place() {
    // Persistent tensors first, in declaration order; then replay the schedules.
    auto run = [&](const std::vector<Step> &steps, bool count_activations) {
      Placer pl{plan.tensors};
      std::size_t act = 0, act_peak = 0;
      for (int t = 0; t < int(plan.tensors.size()); ++t) {
        const Role r = plan.tensors[t].role;
        if (plan.tensors[t].view_of < 0 && (r == Role::params || r == Role::grads || r == Role::adam_m ||
                                            r == Role::adam_v || r == Role::data || r == Role::metrics))
          pl.alloc(t);
      }
      for (const Step &st : steps) {
        for (int t : st.alloc) {
          pl.alloc(t);
          if (is_activation(plan.tensors[t].role)) act += plan.tensors[t].bytes();
        }
        act_peak = std::max(act_peak, act);
        for (int t : st.free) {
          pl.release(t);
          if (is_activation(plan.tensors[t].role)) act -= plan.tensors[t].bytes();
        }
      }
      if (count_activations) plan.activation_bytes = act_peak;
      return pl.peak;
    };
    // Eval is placed first; training's placement of the tensors both share (the persistent
    // ones, in the same order, so at the same offsets) is the one that stays.
    plan.eval_peak_bytes = run(plan.eval, false);
    plan.peak_bytes = run(plan.train, true);
    for (const Step &st : plan.train) {
      plan.total_launches += 1;
      plan.recompute_launches += st.recompute ? 1 : 0;
    }
  }
};

}  // namespace remat::detail

export namespace remat {

// ---------------------------------------------------------------------------------------------
// Costs and the chain the budget planner sees
// ---------------------------------------------------------------------------------------------
// The seconds of one kernel call: measured (--calibrate) when the table has the kernel, else an
// estimate from its arithmetic (kernel_flops) and the bytes of its arguments.
struct KernelTime {
  KernelKey kernel;
  double seconds = 0;
};
struct CostModel {
  double flop_rate = 5e10;  // flop/s
  double byte_rate = 1e10;  // bytes/s of arguments read and written
  double launch = 5e-6;     // seconds per call
  // bytes/s each way between device memory and pinned host memory; 0: checkpoints are not
  // offloaded (the CPU, whose arena is host memory already)
  double transfer_rate = 0;
  std::vector<KernelTime> measured{};
  constexpr double seconds(const KernelKey &kernel, double flops, double bytes) const {
    for (const KernelTime &k : measured)
      if (k.kernel == kernel) return k.seconds;
    return flops / flop_rate + bytes / byte_rate + launch;
  }
};

// One unit of the chain as the dynamic program sees it: bytes as the arena holds them (each
// tensor aligned), per Keep (all, selective, nothing).
struct Link {
  int stage = -1;
  long long x = 0;                           // its input (0: the batch, which is persistent)
  long long y = 0;                           // its output
  long long dx = 0;                          // its input's gradient (0: none); for the loss, the logits' gradient
  std::array<long long, 3> saved{};          // internals its forward keeps
  std::array<long long, 3> forward_temp{};   // a forward's short-lived tensors (scratch, workspace)
  std::array<long long, 3> backward_temp{};  // a backward's ([nothing]: the fused recompute's)
  std::array<double, 3> forward_time{}, backward_time{};  // loss: forward_time[0]
  std::array<bool, 3> can{};  // keep all, keep selective, recompute: whether the kernels exist
  double offload_time = -1;   // seconds to copy its input out and back (< 0: not offloaded)
};
struct Chain {
  std::vector<Link> links;   // the units, then the loss
  long long persistent = 0;  // parameters, gradients, moments, batch, metrics
  constexpr int n() const { return int(links.size()) - 1; }
  // whether some checkpoint may wait in host memory (the costs carry a transfer rate)
  constexpr bool offloadable() const {
    return std::ranges::any_of(links, [](const Link &l) { return l.offload_time >= 0; });
  }
};

constexpr Chain chain_of(const Model &m, int batch, Precision precision, Gemms gemms, const CostModel &costs = {}) {
  detail::Builder b{m, StagePolicies{}, Strategy{}, batch, precision, gemms};
  b.setup();
  Chain c;
  c.persistent = (long long)b.persistent_bytes();
  const long long rows = b.n_rows;
  auto bytes = [&](const KernelArg &a) {
    return (long long)align_up(std::size_t(a.tensor.elements(rows) * element_bytes(a.element)));
  };
  // Adds the kernel's tensors of `role` to *to; returns its estimated or measured seconds.
  auto kernel = [&](int stage, Variant v, auto &&count) {
    const std::vector<KernelArg> sig = signature(m, stage, v, precision, gemms);
    double moved = 0;
    for (const KernelArg &a : sig)
      if (!a.is_scalar()) {
        moved += double(bytes(a));
        count(a.role, bytes(a));
      }
    const double flops = stage >= 0 ? kernel_flops(m.stages[stage], v, rows, gemms) : 0;
    return costs.seconds(kernel_key(stage, v, precision), flops, moved);
  };
  for (const Unit &u : b.units) {
    Link l;
    l.stage = u.stage;
    l.x = c.links.empty() ? 0 : c.links.back().y;
    if (costs.transfer_rate > 0 && l.x > 0) l.offload_time = 2.0 * double(l.x) / costs.transfer_rate;
    for (Keep keep : {Keep::all, Keep::selective, Keep::nothing}) {
      const int k = int(keep);
      l.can[k] = has_kernel(m, u.stage, backward_variant(keep));
      if (!has_kernel(m, u.stage, forward_variant(keep))) continue;
      l.forward_time[k] = kernel(u.stage, forward_variant(keep), [&](ArgRole r, long long n) {
        if (r == ArgRole::block_output) l.y = n;
        if (r == ArgRole::saved) l.saved[k] += n;
        if (r == ArgRole::scratch || r == ArgRole::workspace) l.forward_temp[k] += n;
      });
      if (!l.can[k]) continue;
      l.backward_time[k] = kernel(u.stage, backward_variant(keep), [&](ArgRole r, long long n) {
        if (r == ArgRole::input_grad) l.dx = n;
        if (r == ArgRole::scratch || r == ArgRole::workspace) l.backward_temp[k] += n;
      });
    }
    c.links.push_back(l);
  }
  Link loss;
  loss.x = c.links.back().y;
  loss.forward_time[0] = kernel(-1, Variant::loss, [&](ArgRole r, long long n) {
    if (r == ArgRole::input_grad) loss.dx = n;
  });
  c.links.push_back(loss);
  return c;
}

// The live bytes of a decision's own steps in sub-problem (s, t), above what its caller holds (the
// input of s and the gradient of t's output are counted): one place for the memory model that
// evaluate, least_memory and fastest_within share.
constexpr long long gradient_after(const Chain &c, int t) { return t < c.n() ? c.links[t + 1].dx : 0; }
constexpr long long loss_peak(const Chain &c) { return c.links[c.n()].x + c.links[c.n()].dx; }
constexpr long long recompute_peak(const Chain &c, int s, int t) {
  const Link &l = c.links[s];
  return l.x + gradient_after(c, t) + l.dx + l.backward_temp[2];
}
// keep (Keep k): its forward's step and its backward's step
constexpr long long keep_peak(const Chain &c, int s, int t, int k) {
  const Link &l = c.links[s];
  const long long next = s < t ? c.links[s + 1].dx : gradient_after(c, t);
  return std::max(l.x + gradient_after(c, t) + l.y + l.saved[k] + l.forward_temp[k],
                  l.x + l.saved[k] + next + l.dx + l.backward_temp[k]);
}
// the last step of a sub-problem whose first unit s ends with backward k (keep all, keep selective,
// recompute) or, for s == n, with the loss: what an offloaded checkpoint's fetch overlaps
constexpr long long last_peak(const Chain &c, int s, int k) {
  if (s == c.n()) return loss_peak(c);
  const Link &l = c.links[s];
  return k == 2 ? recompute_peak(c, s, s) : l.x + l.saved[k] + c.links[s + 1].dx + l.dx + l.backward_temp[k];
}
// ... and what stays live beside its sub-problem (s + 1, t)
constexpr long long keep_held(const Chain &c, int s, int k) { return c.links[s].x + c.links[s].saved[k]; }
// checkpoint: forward_discard of unit j (s <= j) in its sweep
constexpr long long sweep_peak(const Chain &c, int s, int t, int j) {
  const Link &l = c.links[j];
  return c.links[s].x + gradient_after(c, t) + (j > s ? l.x : 0) + l.y + l.forward_temp[2];
}

// An offloaded checkpoint (the input of s, copied out beside the forward of s, fetched beside the
// last step of sub-problem (v, t)) saves memory only if some step lies between the two: the
// sweep s..v-1 and (v, t) take at least three steps. `steps_after` counts (v, t)'s, up to 3.
constexpr bool offload_helps(int s, int v, int steps_after) { return (v - s) + steps_after >= 3; }

// The peak (live bytes above the persistent ones) and the seconds of sub-problem (s, t) run by
// `st`, counted as the planner schedules it: a step's new tensors are live with everything live
// before it, and die after it. Also the live bytes of its last step and its steps (up to 3).
struct Outcome {
  long long peak = 0;
  double seconds = 0;
  long long last = 0;
  int steps = 0;
};
constexpr Outcome evaluate(const Chain &c, const Strategy &st, int s, int t) {
  const Link &l = c.links[s];
  const Decision &d = st.at(s, t);
  switch (d.op) {
  case Decision::Op::loss: return {loss_peak(c), l.forward_time[0], loss_peak(c), 1};
  case Decision::Op::recompute: return {recompute_peak(c, s, t), l.backward_time[2], recompute_peak(c, s, t), 1};
  case Decision::Op::keep: {
    const int k = int(d.keep);
    Outcome o{keep_peak(c, s, t, k), l.forward_time[k] + l.backward_time[k], last_peak(c, s, k), 2};
    if (s < t) {
      const Outcome rest = evaluate(c, st, s + 1, t);
      o.peak = std::max(o.peak, keep_held(c, s, k) + rest.peak);
      o.seconds += rest.seconds;
      o.steps = 3;
    }
    return o;
  }
  case Decision::Op::checkpoint: {
    const Outcome later = evaluate(c, st, d.until, t), again = evaluate(c, st, s, d.until - 1);
    const bool offloaded = d.offload && l.x > 0 && offload_helps(s, d.until, later.steps);
    Outcome o{0, 0, again.last, 3};
    for (int j = s; j < d.until; ++j) {
      o.peak = std::max(o.peak, sweep_peak(c, s, t, j) - (offloaded && j > s ? l.x : 0));
      o.seconds += c.links[j].forward_time[2];
    }
    const long long during = offloaded ? std::max(later.peak, later.last + l.x) : l.x + later.peak;
    o.peak = std::max({o.peak, during, again.peak});
    o.seconds += later.seconds + again.seconds + (offloaded ? std::max(l.offload_time, 0.0) : 0);
    return o;
  }
  case Decision::Op::unset: break;
  }
  throw "remat planner: the strategy leaves a sub-problem undecided";
}

struct BudgetSolution {
  Strategy strategy{};
  bool feasible = false;
  long long peak = 0;  // persistent + evaluate(...).peak: the plan's peak when placement leaves no holes
  double seconds = 0;  // predicted forward + loss + backward time
  long long unit = 1;  // the table's memory unit in bytes (sizes are rounded up to it)
};

// The strategy of least peak (ties: least time), exactly: a peak composes by max and +, so the
// least peak of (s, t) follows from its sub-problems' least peaks.
constexpr BudgetSolution least_memory(const Chain &c) {
  const int n = c.n();
  const std::vector<Link> &L = c.links;
  Strategy st(n);
  std::vector<Outcome> best;
  for (int i = 0; i < (n + 1) * (n + 1); ++i) best.push_back({});
  auto at = [&](int s, int t) -> Outcome & { return best[std::size_t(s * (n + 1) + t)]; };
  for (int len = 0; len <= n; ++len)
    for (int s = 0; s + len <= n; ++s) {
      const int t = s + len;
      Outcome o{-1, 0};
      Decision pick;
      auto offer = [&](Outcome cand, Decision dec) {
        if (o.peak < 0 || cand.peak < o.peak || (cand.peak == o.peak && cand.seconds < o.seconds)) {
          o = cand;
          pick = dec;
        }
      };
      if (s == n) {
        offer({loss_peak(c), L[n].forward_time[0]}, {Decision::Op::loss});
      } else {
        if (s == t && L[s].can[2]) offer({recompute_peak(c, s, t), L[s].backward_time[2]}, {Decision::Op::recompute});
        for (int k = 0; k < 2; ++k) {
          if (!L[s].can[k]) continue;
          Outcome cand{keep_peak(c, s, t, k), L[s].forward_time[k] + L[s].backward_time[k]};
          if (s < t) {
            cand.peak = std::max(cand.peak, keep_held(c, s, k) + at(s + 1, t).peak);
            cand.seconds += at(s + 1, t).seconds;
          }
          offer(cand, {Decision::Op::keep, Keep(k)});
        }
        long long sweep = 0;
        double sweep_time = 0;
        for (int u = s + 1; u <= t; ++u) {
          sweep = std::max(sweep, sweep_peak(c, s, t, u - 1));
          sweep_time += L[u - 1].forward_time[2];
          const Outcome later = at(u, t), again = at(s, u - 1);
          offer({std::max({sweep, L[s].x + later.peak, again.peak}), sweep_time + later.seconds + again.seconds},
                {Decision::Op::checkpoint, Keep::all, u});
        }
      }
      at(s, t) = o;
      st.at(s, t) = pick;
    }
  const Outcome top = at(0, n);
  return {st, true, c.persistent + top.peak, top.seconds, 1};  // (decisions of unreached sub-problems are never read)
}

constexpr long long gcd(long long a, long long b) {
  while (b) {
    const long long r = a % b;
    a = b;
    b = r;
  }
  return a;
}

// The fastest strategy within `budget` bytes that one table finds: the dynamic program of Beaumont et
// al. over sub-problems (s, t) and the memory left m, in units of the greatest common divisor of
// the chain's sizes (exact) or, where that makes the table too large for the chain's length, of
// budget / max_slots (sizes rounded up: the plans found fit, a few near the budget may be missed).
// Where the chain's links can be offloaded (a transfer rate in the costs), a checkpoint may wait in
// host memory: then the sub-problem after it runs without it but for its last step (the fetch),
// so the table keeps, per (s, t, m), the best time for each way unit s's last backward runs
// (keep all, keep selective, recompute; the loss for s = n): that step's bytes are known.
constexpr BudgetSolution fastest_within_one_table(const Chain &c, long long budget) {
  const int n = c.n();
  const std::vector<Link> &L = c.links;
  const long long avail = budget - c.persistent;
  BudgetSolution fail;
  if (avail < 0) return fail;
  // the memory unit
  long long g = 0;
  for (const Link &l : L) {
    for (long long v : {l.x, l.y, l.dx}) g = gcd(g, v);
    for (int k = 0; k < 3; ++k)
      for (long long v : {l.saved[k], l.forward_temp[k], l.backward_temp[k]}) g = gcd(g, v);
  }
  if (g == 0) g = 1;
  // classes of the last backward: three where a checkpoint can be offloaded, else one (the best)
  const int K = c.offloadable() ? 3 : 1;
  const double work = K * double(n + 1) * (n + 1) * (n + 3) / 6.0;
  const long long max_slots = std::clamp((long long)(2e7 / work), 32LL, 4096LL);
  long long unit = g;
  if (avail / unit > max_slots) unit = (avail + max_slots - 1) / max_slots;
  const int M = int(avail / unit);
  // the chain in memory units, each size rounded up
  Chain u = c;
  for (Link &l : u.links) {
    for (long long *v : {&l.x, &l.y, &l.dx}) *v = (*v + unit - 1) / unit;
    for (int k = 0; k < 3; ++k)
      for (long long *v : {&l.saved[k], &l.forward_temp[k], &l.backward_temp[k]}) *v = (*v + unit - 1) / unit;
  }
  const std::vector<Link> &U = u.links;
  const double inf = 1e300;
  const std::size_t width = std::size_t(M) + 1, cells = std::size_t((n + 1) * (n + 1)) * width;
  // per cell and last backward k: the best time, and its decision: -1 none, 0 keep all, 1 keep
  // selective, 2 recompute, 3 loss, 4 + 2 v: checkpoint until v, 5 + 2 v: the same offloaded
  std::vector<double> cost, best_of;  // best_of: the least over k
  std::vector<int> choice;
  cost.reserve(std::size_t(K) * cells);
  choice.reserve(std::size_t(K) * cells);
  best_of.reserve(cells);
  for (std::size_t i = 0; i < std::size_t(K) * cells; ++i) {
    cost.push_back(inf);
    choice.push_back(-1);
  }
  for (std::size_t i = 0; i < cells; ++i) best_of.push_back(inf);
  auto idx = [&](int s, int t, long long m) { return std::size_t(s * (n + 1) + t) * width + std::size_t(m); };
  auto at = [&](int s, int t, long long m, int k) { return std::size_t(K) * idx(s, t, m) + std::size_t(k % K); };
  // the last backward class of (v, t)'s best time within m, among those that allow offloading
  // the input of s (its fetch beside that step fits, and some step lies between)
  auto best_after_offload = [&](int s, int v, int t, long long m, int &k_out) {
    double best = inf;
    for (int k = 0; k < 3; ++k) {
      const int steps = v < t ? 3 : v == n || k == 2 ? 1 : 2;  // (v, v): the loss, a recompute or keep's two
      if (!offload_helps(s, v, steps) || last_peak(u, v, k) + U[s].x > m) continue;
      if (cost[at(v, t, m, k)] < best) {
        best = cost[at(v, t, m, k)];
        k_out = k;
      }
    }
    return best;
  };
  for (int len = 0; len <= n; ++len)
    for (int s = 0; s + len <= n; ++s) {
      const int t = s + len;
      long long keep_steps[2]{}, held[2]{};
      double keep_time[2]{};
      for (int k = 0; k < 2; ++k) {
        keep_steps[k] = keep_peak(u, s, t, k);
        held[k] = keep_held(u, s, k);
        keep_time[k] = L[s].forward_time[k] + L[s].backward_time[k];
      }
      // per checkpoint until v: the forward sweep's peak (offloaded: the input of s dies after the
      // first forward) and time
      const bool can_offload = s < n && L[s].offload_time >= 0;
      std::vector<long long> sweep, sweep_offloaded;
      std::vector<double> sweep_time;
      for (int v = s + 1; v <= t; ++v) {
        const long long at = sweep_peak(u, s, t, v - 1);
        sweep.push_back(std::max(sweep.empty() ? 0 : sweep.back(), at));
        sweep_offloaded.push_back(
            std::max(sweep_offloaded.empty() ? 0 : sweep_offloaded.back(), v - 1 > s ? at - U[s].x : at));
        sweep_time.push_back((sweep_time.empty() ? 0 : sweep_time.back()) + L[v - 1].forward_time[2]);
      }
      const long long own_recompute = s < n ? recompute_peak(u, s, t) : 0, own_loss = loss_peak(u);
      for (long long m = 0; m <= M; ++m) {
        double best[3] = {inf, inf, inf};
        int pick[3] = {-1, -1, -1};
        auto offer = [&](int k, double cand, int decision) {
          if (cand < best[k % K]) {
            best[k % K] = cand;
            pick[k % K] = decision;
          }
        };
        if (s == n) {
          if (own_loss <= m) offer(0, L[n].forward_time[0], 3);
        } else {
          if (s == t && L[s].can[2] && own_recompute <= m) offer(2, L[s].backward_time[2], 2);
          for (int k = 0; k < 2; ++k) {
            if (!L[s].can[k] || keep_steps[k] > m) continue;
            if (s == t)
              offer(k, keep_time[k], k);
            else if (m - held[k] >= 0)
              offer(k, keep_time[k] + best_of[idx(s + 1, t, m - held[k])], k);
          }
          for (int v = s + 1; v <= t; ++v) {
            const double *again = &cost[at(s, v - 1, m, 0)];
            if (sweep[v - s - 1] <= m && m - U[s].x >= 0) {
              const double later = best_of[idx(v, t, m - U[s].x)];
              for (int k = 0; k < K; ++k) offer(k, sweep_time[v - s - 1] + later + again[k], 4 + 2 * v);
            }
            if (can_offload && sweep_offloaded[v - s - 1] <= m) {
              int k_later = 0;
              const double later = best_after_offload(s, v, t, m, k_later) + L[s].offload_time;
              for (int k = 0; k < K; ++k) offer(k, sweep_time[v - s - 1] + later + again[k], 5 + 2 * v);
            }
          }
        }
        for (int k = 0; k < K; ++k) {
          cost[at(s, t, m, k)] = best[k];
          choice[at(s, t, m, k)] = best[k] < inf ? pick[k] : -1;
          best_of[idx(s, t, m)] = std::min(best_of[idx(s, t, m)], best[k]);
        }
      }
    }
  auto best_class = [&](int s, int t, long long m) {
    int k = 0;
    for (int j = 1; j < K; ++j)
      if (cost[at(s, t, m, j)] < cost[at(s, t, m, k)]) k = j;
    return k;
  };
  if (best_of[idx(0, n, M)] >= inf) return fail;
  Strategy st(n);
  auto rebuild = [&](auto &self, int s, int t, long long m, int k) -> void {
    const int pick = choice[at(s, t, m, k)];
    if (pick == 3)
      st.at(s, t) = {Decision::Op::loss};
    else if (pick == 2)
      st.at(s, t) = {Decision::Op::recompute};
    else if (pick < 2) {
      st.at(s, t) = {Decision::Op::keep, Keep(pick)};
      if (s < t) {
        const long long rest = m - keep_held(u, s, pick);
        self(self, s + 1, t, rest, best_class(s + 1, t, rest));
      }
    } else {
      const int v = (pick - 4) / 2;
      const bool offloaded = (pick - 4) % 2 == 1;
      st.at(s, t) = {Decision::Op::checkpoint, Keep::all, v, offloaded};
      if (offloaded) {
        int k_later = 0;
        best_after_offload(s, v, t, m, k_later);
        self(self, v, t, m, k_later);
      } else {
        self(self, v, t, m - U[s].x, best_class(v, t, m - U[s].x));
      }
      self(self, s, v - 1, m, k);
    }
  };
  rebuild(rebuild, 0, n, M, best_class(0, n, M));
  const Outcome o = evaluate(c, st, 0, n);
  return {st, true, c.persistent + o.peak, o.seconds, unit};
}

// The fastest strategy whose peak is at most `budget` bytes. Where offloading is an option its
// table has three times the cells and, on a long chain, a coarser memory unit that can miss plans
// a finer one finds: the strategy without offload (a table of its own) is solved too, and the
// faster one kept, so that offering offload never makes a plan slower.
constexpr BudgetSolution fastest_within(const Chain &c, long long budget) {
  BudgetSolution best = fastest_within_one_table(c, budget);
  if (!c.offloadable()) return best;
  Chain on_device = c;
  for (Link &l : on_device.links) l.offload_time = -1;
  BudgetSolution kept = fastest_within_one_table(on_device, budget);
  if (kept.feasible && (!best.feasible || kept.seconds < best.seconds)) best = std::move(kept);
  return best;
}

// A plan, or why there is none (an infeasible memory budget).
struct Planned {
  Plan plan;
  Message error;
  constexpr bool ok() const { return error.size() == 0; }
};

// The plan for one micro-batch of `batch` samples under each stage's policy (a single Policy:
// every stage's). Runs at compile time for a policy fixed in the model module and at run time
// for one chosen by a flag. A budget policy is solved by fastest_within with `costs`; if the
// arena's placement of that plan leaves holes that lift its peak past the budget, the budget is
// solved again that much smaller. The GEMM choice must be the kernels' (gemms_for).
constexpr Plan plan_of(const Model &m, const StagePolicies &policies, const Strategy &st, int batch,
                       Precision precision, Gemms gemms) {
  detail::Builder builder{m, policies, st, batch, precision, gemms};
  builder.build();
  Plan plan = std::move(builder.plan);
  plan.policy = policies.stage[0];
  for (int s = m.n_stages - 1; s >= 0; --s)
    if (m.stages[s].checkpointable) plan.policy = policies.stage[s];
  plan.policy_label = policies_name(m, policies);
  return plan;
}

// The plan of least peak: least_memory's strategy, unless the arena's placement (first fit, which
// can leave holes of a few KiB) makes one of the fixed policies' smaller.
constexpr Plan smallest_plan(const Model &m, const StagePolicies &policies, int batch, Precision precision,
                             Gemms gemms) {
  Plan best =
      plan_of(m, policies, least_memory(chain_of(m, batch, precision, gemms)).strategy, batch, precision, gemms);
  for (const Policy &p : {full, none, sqrt_n}) {
    Plan other = plan_of(m, policies, lower(m, p), batch, precision, gemms);
    if (other.peak_bytes < best.peak_bytes) best = std::move(other);
  }
  return best;
}
constexpr Plan smallest_plan(const Model &m, int batch, Precision precision = Precision::fp32,
                             Gemms gemms = Gemms::halide) {
  return smallest_plan(m, StagePolicies{}, batch, precision, gemms);
}

constexpr Planned plan_for(const Model &m, const StagePolicies &policies, int batch,
                           Precision precision = Precision::fp32, Gemms gemms = Gemms::halide,
                           const CostModel &costs = {}) {
  auto build = [&](const Strategy &st) { return plan_of(m, policies, st, batch, precision, gemms); };
  const Policy *budget = budget_of(m, policies);
  if (!budget) return {build(lower(m, policies)), {}};
  long long bytes = budget->budget_bytes;
  if (budget->budget_percent > 0) bytes = (long long)build(lower(m, none)).peak_bytes * budget->budget_percent / 100;
  const Chain chain = chain_of(m, batch, precision, gemms, costs);
  Plan smallest = smallest_plan(m, policies, batch, precision, gemms);
  // below the smallest plan that keeps its checkpoints on the device only offloading can fit
  if ((long long)smallest.peak_bytes > bytes && !chain.offloadable())
    return {{},
            cat<Message>("remat: a memory budget of ", bytes, " bytes is infeasible at batch ", batch,
                         ": the smallest plan of this model needs ", (long long)smallest.peak_bytes, " bytes")};
  long long target = bytes;
  for (int attempt = 0; attempt < 4; ++attempt) {
    const BudgetSolution sol = fastest_within(chain, target);
    if (!sol.feasible) break;
    Plan plan = build(sol.strategy);
    if ((long long)plan.peak_bytes <= bytes) return {std::move(plan), {}};
    target -= (long long)plan.peak_bytes - bytes;
  }
  if ((long long)smallest.peak_bytes > bytes)
    return {{},
            cat<Message>("remat: a memory budget of ", bytes, " bytes is infeasible at batch ", batch,
                         ": the smallest plan of this model needs ", (long long)smallest.peak_bytes,
                         " bytes (offloading checkpoints did not fit either)")};
  return {std::move(smallest), {}};
}

constexpr Plan make_plan(const Model &m, const StagePolicies &policies, int batch,
                         Precision precision = Precision::fp32, Gemms gemms = Gemms::halide,
                         const CostModel &costs = {}) {
  Planned p = plan_for(m, policies, batch, precision, gemms, costs);
  if (!p.ok()) throw "remat planner: the memory budget is infeasible (plan_for says by how much)";
  return std::move(p.plan);
}

// A model module's policy with a budget, checked where the model is built: an infeasible budget
// is a compile error that states the least feasible bytes. Gemms as the CPU's fp32 kernels use.
template <Model M, Policy P, int Batch, Precision Pr = Precision::fp32, Gemms G = Gemms::library>
consteval bool feasible() {
  constexpr Message error = plan_for(M, annotated(M, P), Batch, Pr, G).error;
  static_assert(error.size() == 0, error);
  return true;
}

}  // namespace remat
