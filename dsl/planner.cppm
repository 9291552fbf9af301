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
struct Segment { int first, last; };

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
  case Policy::Kind::selective: break;
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

enum class Role : std::uint8_t {
  params, grads, adam_m, adam_v,  // flat, persistent; per-layer tensors are views into them
  data,                           // batch inputs and labels, persistent
  block_input,                    // a block's input kept for its backward (or the next block)
  internal,                       // an internal saved for backward
  recomputed,                     // an internal rebuilt or discarded within one kernel call
  gradient,                       // gradient flowing between blocks
  scratch,                        // short-lived workspace of one backward kernel
  metrics,                        // per-row loss and correctness, persistent
};

// Tensors that hold values from outside the schedule (parameters, optimizer state, the batch,
// the metrics): live through every step; all others live from their alloc to their free.
constexpr bool persistent(Role r) {
  return r == Role::params || r == Role::grads || r == Role::adam_m || r == Role::adam_v || r == Role::data ||
         r == Role::metrics;
}

constexpr bool is_activation(Role r) {
  return r == Role::block_input || r == Role::internal || r == Role::recomputed;
}

struct Tensor {
  Name name;        // s<stage>.b<block>.<local> (eval.<...> for evaluation) or a global name; a
                    // segment replay's rebuilt copies reuse the names of the originals
  Role role{};
  int dims = 1;
  std::array<long long, 2> extent{};
  int elem_bytes = 4;
  int view_of = -1;           // for views: the root tensor and the byte offset inside it
  std::size_t offset = 0;     // roots: arena offset; views: offset inside the root
  std::size_t host_offset = 0;  // offloaded tensors: offset in the pinned host buffer
  // Where it comes from, for reports: its block, the layer that makes it, its name there (the
  // kernel argument's: h3, rstd2, y, p0_w), what it holds, and for a saved internal the layer
  // whose backward reads it.
  int stage = -1, block = -1, layer = -1;
  Name local;
  LocalTensor::Kind kind = LocalTensor::Kind::activation;
  int read_by = -1;
  Init init = Init::zeros;  // parameters: how the trainer starts them
  constexpr std::size_t bytes() const {
    long long n = elem_bytes;
    for (int d = 0; d < dims; ++d) n *= extent[d];
    return std::size_t(n);
  }
};


// A buffer argument of a kernel call, bound to a tensor of the plan.
struct Arg {
  Name name;   // the kernel argument's name (for messages: the executor binds by position)
  int tensor;  // index into Plan::tensors
  Access access = Access::read;
};

struct Step {
  int stage = -1;
  Variant variant{};
  int block = 0;           // index of the block within its stage
  int rng_block = 0;       // dropout counter key of this block (unique per block of the model)
  bool recompute = false;  // runs forward work a second time
  bool weight_decay = true;  // adamw: whether this range of parameters is decayed
  double flops = 0;          // kernel_flops of this call
  // The kernel's arguments in its signature's order: its scalars (values the executor supplies),
  // then its buffers (those it reads, then those it writes).
  std::vector<Scalar> scalars;
  std::vector<Arg> args;
  std::vector<int> alloc;  // tensors that become live before the kernel runs
  std::vector<int> free;   // tensors that die after it
  // Offload (Policy::offload): transfers between arena tensors and the pinned host buffer, on a
  // copy stream ordered by events. Before the kernel: wait for the copy-out of `await_out` (their
  // memory is about to be reused), start bringing back each `fetch` pair {host copy of tensor a,
  // into tensor b} (b is in `alloc`), and wait for the arrival of `await_in`. After it: copy each
  // `offload` tensor out.
  std::vector<int> await_out, await_in, offload;
  std::vector<std::pair<int, int>> fetch;
};

inline constexpr std::size_t arena_alignment = 64;

struct Plan {
  Policy policy{};
  Precision precision{};
  Gemms gemms{};
  int batch = 0;               // samples per micro-batch
  long long rows = 0;          // rows per micro-batch: samples x rows per sample
  std::vector<Tensor> tensors;
  std::vector<Step> train;     // one micro-batch: forward, loss, backward
  std::vector<Step> optimize;  // AdamW over the flat parameters
  std::vector<Step> eval;      // forward-discard of every stage, then the loss kernel
  std::size_t peak_bytes = 0;         // arena size: the highest byte any live tensor reaches
  std::size_t activation_bytes = 0;   // most activation bytes live at once during training
  std::size_t eval_peak_bytes = 0;
  std::size_t offload_bytes = 0;      // pinned host buffer for offloaded checkpoints
  long long param_count = 0;         // parameters (the flat buffers also hold alignment padding)
  int recompute_launches = 0;         // kernels per micro-batch that recompute forward work
  int total_launches = 0;

  constexpr int find(std::string_view name) const {
    for (int i = 0; i < int(tensors.size()); ++i)
      if (tensors[i].name == name) return i;
    return -1;
  }
  // Where tensor t starts in the arena (a view: its root's offset plus its own).
  constexpr std::size_t arena_offset(int t) const {
    const Tensor &x = tensors[t];
    return x.offset + (x.view_of >= 0 ? tensors[x.view_of].offset : 0);
  }
};

// Arena offsets and sizes are multiples of arena_alignment.
constexpr std::size_t align_up(std::size_t v) {
  return (v + arena_alignment - 1) / arena_alignment * arena_alignment;
}

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
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return tensors[a].offset < tensors[b].offset; });
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
  Policy policy;
  int batch;
  Precision precision;
  Gemms gemms;
  long long n_rows = 0;
  Plan plan{};

  constexpr int add(Tensor t) {
    plan.tensors.push_back(t);
    return int(plan.tensors.size()) - 1;
  }
  bool naming_eval = false;  // evaluation tensors are named eval.<name>
  constexpr int local(int stage, int block, Role role, const LocalTensor &lt, int read_by = -1) {
    Tensor t{cat(naming_eval ? "eval." : "", prefix(stage, block).view(), lt.name.view()), role, lt.dims};
    t.elem_bytes = element_bytes(lt, precision);
    for (int d = 0; d < lt.dims; ++d) t.extent[d] = lt.extent[d] < 0 ? n_rows : lt.extent[d];
    t.stage = stage;
    t.block = block;
    t.layer = lt.layer;
    t.local = lt.name;
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
  template <class Bind> constexpr void bind(Step &st, Bind bind) {
    for (const KernelArg &a : signature(m, st.stage, st.variant, precision, gemms)) {
      if (a.is_scalar()) {
        st.scalars.push_back(a.scalar);
        continue;
      }
      const int t = bind(a);
      if (t < 0) throw "remat planner: a kernel argument the planner cannot bind";
      st.args.push_back({a.tensor.name, t, a.access});
    }
  }
  constexpr void free_activation(Step &st, int t) const {  // data tensors stay
    if (plan.tensors[t].role != Role::data) st.free.push_back(t);
  }
  static constexpr Name prefix(int stage, int block) { return cat("s", stage, ".b", block, "."); }

  // Per (stage, block): tensor ids of parameters and gradients (views into the flat buffers), in
  // the order of params(block).
  std::vector<std::vector<std::vector<int>>> param_args{}, grad_args{};
  int params_root = -1, grads_root = -1, m_root = -1, v_root = -1;
  long long decayed_slots = 0;  // floats of the decayed range, padding included
  static constexpr long long slot_alignment = arena_alignment / 4;

  constexpr void make_params() {
    params_root = add({"params", Role::params, 1});
    grads_root = add({"grads", Role::grads, 1});
    m_root = add({"adam_m", Role::adam_m, 1});
    v_root = add({"adam_v", Role::adam_v, 1});
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
            if (lt.decay != decayed) { ++i; continue; }
            const int p = local(s, b, Role::params, lt);
            slots = (slots + slot_alignment - 1) / slot_alignment * slot_alignment;
            plan.tensors[p].view_of = params_root;
            plan.tensors[p].offset = std::size_t(slots) * 4;
            Tensor g = plan.tensors[p];
            g.name = cat(prefix(s, b).view(), grad_name(lt.name).view());
            g.role = Role::grads;
            g.view_of = grads_root;
            g.local = grad_name(lt.name);
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

  struct Unit { int stage, block, index, rng; };

  // Forward of one block. Returns the output tensor; the kept internals go to *kept with `role`.
  constexpr int forward(std::vector<Step> &out, const Unit &u, int x, Keep keep, Role role,
                        std::vector<int> *kept) {
    Step st = step(u.stage, forward_variant(keep), u.block, u.rng);
    int y = -1, n_params = 0;
    bind(st, [&](const KernelArg &a) {
      switch (a.role) {
      case ArgRole::block_input: return x;
      case ArgRole::parameter: return param_args[u.stage][u.block][n_params++];
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
  constexpr int backward(std::vector<Step> &out, const Unit &u, int x, int dy,
                         const std::vector<int> &kept, Keep keep) {
    Step st = step(u.stage, backward_variant(keep), u.block, u.rng);
    st.recompute = keep != Keep::all;
    int dx = -1, n_params = 0, n_prev = 0, n_grads = 0, n_saved = 0;
    bind(st, [&](const KernelArg &a) {
      switch (a.role) {
      case ArgRole::block_input: return x;
      case ArgRole::output_grad: return dy;
      case ArgRole::parameter: return param_args[u.stage][u.block][n_params++];
      // written, and read back when accumulating (in place)
      case ArgRole::gradient: return grad_args[u.stage][u.block][a.access == Access::read ? n_prev++ : n_grads++];
      case ArgRole::input_grad: return dx = live(st, local(st, Role::gradient, a));
      case ArgRole::saved:
        if (n_saved == int(kept.size())) return -1;
        st.free.push_back(kept[n_saved]);
        return kept[n_saved++];
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
  constexpr Step loss_step(int x, int labels, const int (&metrics)[4], Name dlogits_name, bool keep_dlogits) {
    Step st = step(-1, Variant::loss, 0, 0);
    int n_metrics = 0;
    bind(st, [&](const KernelArg &a) {
      switch (a.role) {
      case ArgRole::block_input: return x;
      case ArgRole::labels: return labels;
      case ArgRole::metric: return metrics[n_metrics++];
      case ArgRole::input_grad: {
        const int dlogits = add({dlogits_name, Role::gradient, 2, {m.classes(), n_rows}, element_bytes(a.element)});
        return live(st, dlogits, !keep_dlogits);
      }
      default: return -1;
      }
    });
    st.free.insert(st.free.begin(), x);
    return st;
  }

  // ---- offload ----
  // A checkpoint x read by the forward of the last step: copied out after it; its arena memory
  // is freed one step later (the copy overlaps that step), and the step after waits for the copy
  // before anything can reuse the memory.
  std::vector<std::pair<int, int>> offloaded{};  // {tensor, train step that copied it out}
  constexpr void offload_after(int x) {
    const int at = int(plan.train.size()) - 1;
    plan.train[at].offload.push_back(x);
    plan.tensors[x].host_offset = plan.offload_bytes;
    plan.offload_bytes += align_up(plan.tensors[x].bytes());
    offloaded.push_back({x, at});
  }
  constexpr int offloaded_at(int x) const {
    for (auto [t, at] : offloaded)
      if (t == x) return at;
    return -1;
  }
  // Called when the backward schedule reaches the first step that reads x: a restored copy is
  // allocated one step earlier (the fetch overlaps that step) and awaited by the reader.
  std::vector<std::pair<int, int>> restored{};  // {restored tensor, original}
  constexpr int bring_back(int x) {
    Tensor copy = plan.tensors[x];
    copy.role = Role::block_input;
    const int r = add(copy);
    restored.push_back({r, x});
    return r;
  }
  // After the schedule is built: place the frees, waits and fetches described above.
  constexpr void schedule_transfers() {
    auto &train = plan.train;
    for (auto [x, at] : offloaded) {
      const int release = std::min(at + 1, int(train.size()) - 1);
      train[release].free.push_back(x);
      if (release + 1 < int(train.size())) train[release + 1].await_out.push_back(x);
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

  constexpr void build() {
    n_rows = (long long)batch * m.rows_per_sample();
    plan.policy = policy;
    plan.precision = precision;
    plan.gemms = gemms;
    plan.batch = batch;
    plan.rows = n_rows;
    make_params();
    const int inputs = m.token_input() ? add({"inputs", Role::data, 1, {n_rows, 0}})
                                       : add({"inputs", Role::data, 2, {m.input.width, n_rows},
                                              element_bytes(rows("inputs", m.input.width), precision)});
    const int labels = add({"labels", Role::data, 1, {n_rows, 0}});
    int metrics[4];
    const char *metric_names[4] = {"row_loss", "row_correct", "row_max", "row_lse"};
    for (int i = 0; i < 4; ++i) metrics[i] = add({metric_names[i], Role::metrics, 1, {n_rows, 0}});

    // Blocks in order, with global checkpointable index (-1 for plain stages).
    std::vector<Unit> units;
    int index = 0;
    for (int s = 0; s < m.n_stages; ++s)
      for (int b = 0; b < m.stages[s].repeat; ++b)
        units.push_back({s, b, m.stages[s].checkpointable ? index++ : -1, int(units.size()) * 64});
    // Each repeat stage is its own stack: segments never cross a stage boundary.
    std::vector<Segment> segs;
    for (int s = 0, first = 0; s < m.n_stages; ++s)
      if (m.stages[s].checkpointable) {
        for (Segment g : segments(policy, m.stages[s].repeat)) segs.push_back({first + g.first, first + g.last});
        first += m.stages[s].repeat;
      }
    auto segment_of = [&](int i) -> int {
      for (int k = 0; k < int(segs.size()); ++k)
        if (i >= 0 && segs[k].first <= i && i <= segs[k].last) return k;
      return -1;
    };
    auto keep_of = [&](const Unit &u) {
      if (segment_of(u.index) >= 0) return Keep::nothing;
      return policy.kind == Policy::Kind::selective && u.index >= 0 ? Keep::selective : Keep::all;
    };

    // ---- forward ----
    std::vector<int> block_inputs = filled(units.size(), -1);
    std::vector<std::vector<int>> saved(units.size());
    int x = inputs;
    for (int u = 0; u < int(units.size()); ++u) {
      const int seg = segment_of(units[u].index);
      block_inputs[u] = x;
      const int y = forward(plan.train, units[u], x, keep_of(units[u]), Role::internal, &saved[u]);
      // The input stays if this block's backward reads it or it starts a segment.
      const bool input_kept = seg < 0 || segs[seg].first == units[u].index;
      if (!input_kept) free_activation(plan.train.back(), x);
      if (input_kept && seg >= 0 && policy.offload && plan.tensors[x].role != Role::data) offload_after(x);
      x = y;
    }
    // ---- loss ----
    plan.train.push_back(loss_step(x, labels, metrics, "dlogits", true));
    // ---- backward ----
    int dy = plan.train.back().alloc[0];  // the logits' gradient
    for (int u = int(units.size()) - 1; u >= 0; --u) {
      const int seg = segment_of(units[u].index);
      if (seg < 0) {
        dy = backward(plan.train, units[u], block_inputs[u], dy, saved[u], keep_of(units[u]));
        free_activation(plan.train.back(), block_inputs[u]);
        continue;
      }
      // Last block of a segment: rebuild the inputs and internals of the segment's earlier
      // blocks, then run this block's fused recompute-backward, then the others from saved.
      const int first = u - (units[u].index - segs[seg].first);
      std::vector<int> rebuilt_inputs = filled(units.size(), -1);
      rebuilt_inputs[first] = offloaded_at(block_inputs[first]) >= 0 ? bring_back(block_inputs[first])
                                                                    : block_inputs[first];
      std::vector<std::vector<int>> rebuilt(units.size());
      for (int r = first; r < u; ++r) {
        const int y = forward(plan.train, units[r], rebuilt_inputs[r], Keep::all, Role::recomputed, &rebuilt[r]);
        plan.train.back().recompute = true;
        plan.tensors[y].role = Role::recomputed;  // a rebuilt output, not a kept block input
        rebuilt_inputs[r + 1] = y;
      }
      for (int r = u; r >= first; --r) {
        dy = backward(plan.train, units[r], rebuilt_inputs[r], dy, rebuilt[r], r == u ? Keep::nothing : Keep::all);
        free_activation(plan.train.back(), rebuilt_inputs[r]);
      }
      u = first;
    }
    // the model input's gradient (a repeat stage first: its blocks pass input gradients on) has
    // no reader: it dies with the step that wrote it
    if (dy >= 0) plan.train.back().free.push_back(dy);
    // ---- optimizer: decayed parameters, then the rest ----
    for (bool decayed : {true, false}) {
      const long long begin = decayed ? 0 : decayed_slots;
      const long long end = decayed ? decayed_slots : plan.tensors[params_root].extent[0];
      if (begin == end) continue;
      Step st = step(-1, Variant::adamw, decayed ? 0 : 1, 0);
      st.weight_decay = decayed;
      int views[4]{};  // p, g, m, v over [begin, end)
      for (auto [i, name, root] : {std::tuple{0, "p", params_root}, {1, "g", grads_root}, {2, "m", m_root}, {3, "v", v_root}}) {
        Tensor view{cat(name, decayed ? "_decayed" : "_plain"), plan.tensors[root].role, 1, {end - begin, 0}};
        view.view_of = root;
        view.offset = std::size_t(begin) * 4;
        views[i] = add(view);
      }
      int n_moments = 0;  // m, v read; then m, v written in place
      bind(st, [&](const KernelArg &a) {
        switch (a.role) {
        case ArgRole::parameter: return views[0];
        case ArgRole::gradient: return views[1];
        case ArgRole::moment: return views[2 + n_moments++ % 2];
        default: return -1;
        }
      });
      plan.optimize.push_back(st);
    }
    // ---- evaluation: forward-discard of every block, then the loss kernel ----
    naming_eval = true;
    x = inputs;
    for (const Unit &unit : units) {
      const int y = forward(plan.eval, unit, x, Keep::nothing, Role::internal, nullptr);
      free_activation(plan.eval.back(), x);
      x = y;
    }
    plan.eval.push_back(loss_step(x, labels, metrics, "eval_dlogits", false));

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
        if (plan.tensors[t].view_of < 0 &&
            (r == Role::params || r == Role::grads || r == Role::adam_m || r == Role::adam_v ||
             r == Role::data || r == Role::metrics))
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

// The plan for one micro-batch of `batch` samples under `policy`. Runs at compile time for a
// policy fixed in the model module and at run time for one chosen by a flag.
// The GEMM choice must be the kernels' (runtime::gemms_of: library, but halide for CPU bf16).
constexpr Plan make_plan(const Model &m, Policy policy, int batch, Precision precision = Precision::fp32,
                         Gemms gemms = Gemms::halide) {
  detail::Builder builder{m, policy, batch, precision, gemms};
  builder.build();
  return std::move(builder.plan);
}


}  // namespace remat
