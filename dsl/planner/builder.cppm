// Partition remat.planner:builder: the step builder. Runs a strategy over the chain of blocks, binding
// every argument of every kernel call to a tensor of the plan (by its key), then places the tensors
// first-fit in the arena as the schedule makes them live and lets them die.
module;
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>
export module remat.planner:builder;
import remat.tensors;
import :policies;
import :strategy;
import :plan;
import :offload;

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
    for (const KernelArg &a : signature(m, st.stage, st.variant, precision)) {
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
  std::vector<std::vector<LocalTensor>> stage_params{};  // params(stage), by stage
  // The parameter (or the gradient) of unit u that kernel argument `k` (a parameter or a gradient
  // key, either side of an accumulation) names.
  constexpr int parameter_of(const Unit &u, const TensorKey &k) const {
    const bool gradient = k.slot == Slot::gradient || k.slot == Slot::gradient_prev;
    const std::vector<int> &ids = param_args[u.stage][u.block];
    for (std::size_t i = 0; i < ids.size(); ++i) {  // a tied weight's id is its target's
      TensorKey p = stage_params[std::size_t(u.stage)][i].key;
      if (gradient) p = key::gradient(p, k.slot == Slot::gradient_prev);
      if (p == k) return gradient ? grad_args[u.stage][u.block][i] : ids[i];
    }
    return -1;
  }
  int params_root = -1, grads_root = -1, m_root = -1, v_root = -1;
  long long decayed_slots = 0;  // floats of the decayed range, padding included
  static constexpr long long slot_alignment = arena_alignment / 4;

  // A tied weight (remat::tied_to) is its target's parameter and gradient: one tensor.
  constexpr void share_tied_weights() {
    for (int s = 0; s < m.n_stages; ++s)
      for (int b = 0; b < m.stages[s].repeat; ++b)
        for (int i = 0; const LocalTensor &lt : stage_params[std::size_t(s)]) {
          if (tied_weight(m.stages[s], lt.key)) {
            const Layer &l = m.stages[s].layers[lt.key.layer];
            const TensorKey k = key::parameter(m.stages[l.tie_stage], l.tie_layer, 0);
            int t = 0;
            while (!(stage_params[std::size_t(l.tie_stage)][std::size_t(t)].key == k)) ++t;
            param_args[s][b][i] = param_args[l.tie_stage][0][t];
            grad_args[s][b][i] = grad_args[l.tie_stage][0][t];
          }
          ++i;
        }
  }

  constexpr void make_params() {
    params_root = add({key::of(Slot::params), Role::params, 1});
    grads_root = add({key::of(Slot::grads), Role::grads, 1});
    m_root = add({key::of(Slot::adam_m), Role::adam_m, 1});
    v_root = add({key::of(Slot::adam_v), Role::adam_v, 1});
    param_args.resize(m.n_stages);
    grad_args.resize(m.n_stages);
    for (int s = 0; s < m.n_stages; ++s) {
      stage_params.push_back(params(m.stages[s]));
      const std::size_t n = stage_params.back().size();
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
          for (int i = 0; const LocalTensor &lt : stage_params[std::size_t(s)]) {
            if (lt.decay != decayed || tied_weight(m.stages[s], lt.key)) {
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
    share_tied_weights();
    plan.param_count = count;
    for (int r : {params_root, grads_root, m_root, v_root}) plan.tensors[r].extent[0] = slots;
    plan.shard_slots = slots;
    plan.shard_end = slots;
    if (policies.shard_optimizer && policies.ranks > 1) {
      const long long per_rank = (slots + policies.ranks - 1) / policies.ranks;
      plan.shard_slots = (per_rank + slot_alignment - 1) / slot_alignment * slot_alignment;
      plan.shard_first = std::min(slots, plan.shard_slots * policies.rank);
      plan.shard_end = std::min(slots, plan.shard_first + plan.shard_slots);
      for (int r : {m_root, v_root}) plan.tensors[r].extent[0] = plan.shard_slots;
    }
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
  // `dx_into`: a tensor for dx (else a new one).
  constexpr int backward(std::vector<Step> &out, const Unit &u, int x, int dy, const std::vector<int> &kept, Keep keep,
                         int dx_into = -1) {
    Step st = step(u.stage, backward_variant(keep), u.block, u.rng);
    st.recompute = keep != Keep::all;
    int dx = -1, n_saved = 0;
    // a gradient inside the block and those written over it (gradient_memory) are one tensor,
    // made by whichever binds first
    std::vector<std::pair<TensorKey, int>> gradients;
    auto gradient = [&](const KernelArg &a) {
      const Block &b = m.stages[u.stage];
      const int j = gradient_memory(b, a.tensor.layer());
      const TensorKey k = key::layer_grad(b, j);
      for (const auto &[key, t] : gradients)
        if (key == k) return t;
      gradients.push_back({k, live(st, local(st.stage, st.block, Role::scratch, rows(k, b.layers[j].out)), true)});
      return gradients.back().second;
    };
    bind(st, [&](const KernelArg &a) {
      switch (a.role) {
      case ArgRole::block_input: return x;
      case ArgRole::output_grad: return dy;
      case ArgRole::parameter: return parameter_of(u, a.tensor.key);
      // written, and read back when accumulating (in place)
      case ArgRole::gradient: return parameter_of(u, a.tensor.key);
      case ArgRole::input_grad: return dx = dx_into >= 0 ? dx_into : live(st, local(st, Role::gradient, a));
      case ArgRole::saved: {
        const auto it = std::ranges::find_if(kept, [&](int t) { return plan.tensors[t].key.local() == a.tensor.key; });
        if (it == kept.end()) return -1;
        ++n_saved;
        const int t = transfers.bring_back(plan, *it);
        st.free.push_back(t);
        return t;
      }
      case ArgRole::scratch: return live(st, local(st, Role::recomputed, a), true);
      case ArgRole::workspace:
        return a.tensor.key.slot == Slot::layer_grad ? gradient(a) : live(st, local(st, Role::scratch, a), true);
      case ArgRole::in_place: return gradient(a);
      default: return -1;
      }
    });
    if (n_saved != int(kept.size())) throw "remat planner: a backward reads other tensors than its forward saved";
    st.free.push_back(dy);
    out.push_back(st);
    return dx;
  }

  // Rows `r` of tensor t (a root whose last extent is the rows), as a view.
  constexpr int rows_of(int t, const RowRange &r) {
    Tensor v = plan.tensors[t];
    const std::size_t row_bytes = v.bytes() / std::size_t(v.extent[v.dims - 1]);
    v.extent[v.dims - 1] = r.rows;
    v.view_of = t;
    v.offset = std::size_t(r.first) * row_bytes;
    return add(v);
  }

  // The loss kernel on the logits x (of `chunk`'s rows, or all): writes the logits' gradient (a new
  // tensor) and the metrics.
  constexpr Step loss_step(int x, int labels, bool keep_dlogits, const RowRange *chunk = nullptr) {
    Step st = step(-1, Variant::loss, 0, 0);
    bind(st, [&](const KernelArg &a) {
      switch (a.role) {
      case ArgRole::block_input: return x;
      case ArgRole::labels: return chunk ? rows_of(labels, *chunk) : labels;
      case ArgRole::metric: return chunk ? rows_of(plan.at(a.tensor.key).index, *chunk) : plan.at(a.tensor.key).index;
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

  // The fused head (head_stage) on its input x, chunk by chunk (head_chunks): its forward, the loss
  // and, in training, its backward, which writes the chunk's rows of x's gradient (returned, -1
  // in evaluation) and adds to the parameter gradients that the chunks before it wrote. Frees x.
  constexpr int head(std::vector<Step> &out, int x, bool training) {
    Unit u{head_stage(m), 0, -1, int(units.size()) * 64};
    const long long all_rows = n_rows;
    const int dx = training ? local(u.stage, 0, Role::gradient, rows(key::input_grad(), m.stages[u.stage].in())) : -1;
    const int first_rng = u.rng;
    const std::vector<RowRange> chunks = head_chunks(m, batch, precision);
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const RowRange &r = chunks[c];
      n_rows = r.rows;                  // of the chunk's tensors
      u.rng = first_rng + 64 * int(c);  // its dropout masks: a block's (layer k draws rng + k)
      std::vector<int> kept;
      const int logits = forward(out, u, rows_of(x, r), training ? Keep::all : Keep::nothing, Role::internal, &kept);
      if (training && r.first == 0) out.back().alloc.push_back(dx);
      out.push_back(loss_step(logits, labels, training, &r));
      if (!training) continue;
      backward(out, u, rows_of(x, r), out.back().alloc[0], kept, Keep::all, rows_of(dx, r));
      out.back().accumulates = r.first > 0;
    }
    n_rows = all_rows;
    out.back().free.push_back(x);
    return dx;
  }

  // Offload of checkpoints and named internals (partition :offload).
  Transfers transfers{};
  // Offloads the internals of a forward that keeps them selectively and whose stage's policy names
  // them for offload (save_and_offload_only_these_names).
  constexpr void offload_named(const Unit &u, Keep keep, const std::vector<int> &kept) {
    if (keep != Keep::selective) return;
    const Selection &named = policies.stage[u.stage].selection;
    for (int t : kept) {  // the named layer's output; its row statistics (small) stay
      const Tensor &x = plan.tensors[t];
      if (x.key.layer >= 0 && x.kind == LocalTensor::Kind::activation &&
          named.offloads_tag(m.stages[u.stage].layers[x.key.layer].tag))
        transfers.offload(t, int(plan.train.size()));
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
      if (head_fused(m, policies)) return head(train, x, true);
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
          transfers.offload(x, int(train.size()) - 1);
        z = y;
      }
      const int d_until = solve(d.until, t, z, dy, again);
      return solve(s, d.until - 1, transfers.bring_back(plan, x), d_until, true);
    }
    case Decision::Op::unset: break;
    }
    throw "remat planner: the strategy leaves a sub-problem undecided";
  }

  int inputs = -1;
  // The persistent tensors: parameters, their gradients and moments, the batch, the metrics.
  constexpr void setup() {
    plan.policies = policies;
    n_rows = (long long)batch * m.rows_per_sample();
    make_params();
    const TensorKey in = key::of(Slot::inputs);
    inputs = m.token_input()
                 ? add({in, Role::data, 1, {n_rows, 0}})
                 : add({in, Role::data, 2, {m.input.width, n_rows}, element_bytes(rows(in, m.input.width), precision)});
    labels = add({key::of(Slot::labels), Role::data, 1, {n_rows, 0}});
    for (Slot metric : {Slot::row_loss, Slot::row_correct, Slot::row_max, Slot::row_lse})
      add({key::of(metric), Role::metrics, 1, {n_rows, 0}});
    // data-parallel on the MPI ring: its all-reduce (or, sharded, reduce-scatter) of each parameter
    // gradient receives one chunk of it at a time
    if (policies.ranks > 1 && policies.exchange_buffer) {
      long long largest = 0;
      for (const Tensor &t : plan.tensors)
        if (t.role == Role::grads && t.view_of == grads_root)
          for (int c = 0; c < policies.ranks; ++c) {
            const auto [first, end] = gradient_chunk(plan, t, c);
            largest = std::max(largest, end - first);
          }
      add({key::of(Slot::exchange), Role::exchange, 1, {largest, 0}});
    }
    units = units_of(m, head_fused(m, policies));
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
    plan.batch = batch;
    plan.rows = n_rows;
    // ---- forward, loss, backward: the strategy's sub-problem (0, n) ----
    const int dx = solve(0, int(units.size()), inputs, -1, false);
    // the model input's gradient (a repeat stage first: its blocks pass input gradients on) has
    // no reader: it dies with the step that wrote it
    if (dx >= 0) plan.train.back().free.push_back(dx);
    // ---- optimizer: decayed parameters, then the rest ----
    for (bool decayed : {true, false}) {  // of this plan's shard
      const long long begin = std::max(plan.shard_first, decayed ? 0 : decayed_slots);
      const long long end = std::min(plan.shard_end, decayed ? decayed_slots : plan.tensors[params_root].extent[0]);
      if (begin >= end) continue;
      Step st = step(-1, Variant::adamw, decayed ? 0 : 1, 0);
      st.weight_decay = decayed;
      std::vector<std::pair<Slot, int>> views;  // p, g, m, v over [begin, end); m, v read and written in place
      for (auto [slot, root] : {std::pair{Slot::adamw_param, params_root},
                                {Slot::adamw_grad, grads_root},
                                {Slot::adamw_m, m_root},
                                {Slot::adamw_v, v_root}}) {
        Tensor view{key::adamw(slot, decayed ? 0 : 1), plan.tensors[root].role, 1, {end - begin, 0}};
        view.view_of = root;
        const bool moment = slot == Slot::adamw_m || slot == Slot::adamw_v;  // in the shard's buffers
        view.offset = std::size_t(begin - (moment ? plan.shard_first : 0)) * 4;
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
    if (head_fused(m, policies))
      head(plan.eval, x, false);
    else
      plan.eval.push_back(loss_step(x, labels, false));

    transfers.schedule(plan);
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
            (r == Role::params || r == Role::grads || r == Role::adam_m || r == Role::adam_v || r == Role::data ||
             r == Role::metrics || r == Role::exchange))
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
