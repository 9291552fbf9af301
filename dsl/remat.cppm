// module remat: layer stacks as constexpr values, checkpoint policies, shape checking and the
// planner that lowers (model, policy, batch) to a schedule and an arena layout.
//
// Letter legend used in shape comments: B batch rows, C features of a tensor, K inner width of a
// Linear, O output width of a Linear.
module;
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>
export module remat;

export namespace remat {

// ---------------------------------------------------------------------------------------------
// Names: short fixed strings usable in constant expressions (kernel argument names, messages).
// ---------------------------------------------------------------------------------------------
template <std::size_t Capacity> struct Text {
  std::array<char, Capacity> chars{};
  int length = 0;

  constexpr Text() = default;
  constexpr Text(const char *s) { append(s); }
  constexpr Text &append(std::string_view s) {
    for (char c : s)
      if (length + 1 < int(chars.size())) chars[length++] = c;
    return *this;
  }
  constexpr Text &append(long long v) {
    if (v < 0) { append("-"); v = -v; }
    char digits[24]{};
    int n = 0;
    do { digits[n++] = char('0' + v % 10); v /= 10; } while (v > 0);
    while (n > 0) append(std::string_view(&digits[--n], 1));
    return *this;
  }
  constexpr Text &append(int v) { return append((long long)v); }
  template <std::size_t M> constexpr Text &append(const Text<M> &t) { return append(t.view()); }
  constexpr std::string_view view() const { return {chars.data(), std::size_t(length)}; }
  constexpr const char *data() const { return chars.data(); }
  constexpr int size() const { return length; }
  constexpr bool operator==(const Text &o) const { return view() == o.view(); }
  constexpr bool operator==(std::string_view o) const { return view() == o; }
};

using Name = Text<40>;      // tensor and kernel names
using Message = Text<200>;  // diagnostics

template <class Out = Name, class... Parts> constexpr Out cat(Parts... parts) {
  Out n;
  (n.append(parts), ...);
  return n;
}

// ---------------------------------------------------------------------------------------------
// Layers and blocks
// ---------------------------------------------------------------------------------------------
enum class Op : std::uint8_t { linear, layer_norm, gelu, relu };

constexpr std::string_view op_name(Op op) {
  switch (op) {
  case Op::linear: return "linear";
  case Op::layer_norm: return "layer_norm";
  case Op::gelu: return "gelu";
  case Op::relu: return "relu";
  }
  return "?";
}

// A layer maps C_in features to C_out features per row. 0 means "inferred from the stack".
struct Layer {
  Op op{};
  int in = 0;
  int out = 0;
};

constexpr Layer linear(int in, int out) { return {Op::linear, in, out}; }
constexpr Layer layer_norm(int width = 0) { return {Op::layer_norm, width, width}; }
constexpr Layer gelu() { return {Op::gelu}; }
constexpr Layer relu() { return {Op::relu}; }

// Output of a layer that backward can rebuild cheaply, elementwise, from tensors it already has
// (LayerNorm output from its input and row statistics, ReLU output from its input). Kernels
// that recompute keep such values in registers instead of writing them to memory.
constexpr bool cheap_to_recompute(Op op) { return op == Op::layer_norm || op == Op::relu; }
constexpr bool has_params(Op op) { return op == Op::linear || op == Op::layer_norm; }

inline constexpr int max_block_layers = 8;

// A block: the repeated unit of a stack. Stages made of plain layers are blocks too (repeat 1),
// but only blocks of a `repeat` stage are counted by checkpoint policies.
struct Block {
  std::array<Layer, max_block_layers> layers{};
  int n_layers = 0;
  bool residual = false;
  int repeat = 1;
  bool checkpointable = false;  // true for repeat(n, ...) stages

  constexpr int in() const { return layers[0].in; }
  constexpr int out() const { return layers[n_layers - 1].out; }
  constexpr int width_after(int k) const { return layers[k].out; }
};

template <class... L> constexpr Block residual(L... layers) {
  static_assert(sizeof...(L) <= max_block_layers, "remat: a block holds at most 8 layers");
  Block b;
  ((b.layers[b.n_layers++] = layers), ...);
  b.residual = true;
  return b;
}

template <class... L> constexpr Block sequential(L... layers) {
  Block b = residual(layers...);
  b.residual = false;
  return b;
}

constexpr Block repeat(int n, Block b) {
  b.repeat = n;
  b.checkpointable = true;
  return b;
}

struct Input { int width; };
constexpr Input input(int width) { return {width}; }

struct Loss { int classes = 0; };
constexpr Loss softmax_cross_entropy(int classes = 0) { return {classes}; }

inline constexpr int max_stages = 6;

struct Model {
  int input_width = 0;
  std::array<Block, max_stages> stages{};
  int n_stages = 0;
  Loss loss{};
  int stage_overflow = 0;  // stages past max_stages, reported by check()

  constexpr int n_blocks() const {  // checkpointable blocks
    int n = 0;
    for (int s = 0; s < n_stages; ++s)
      if (stages[s].checkpointable) n += stages[s].repeat;
    return n;
  }
  constexpr int classes() const { return stages[n_stages - 1].out(); }
};

namespace detail {
constexpr void add(Model &m, Input in) { m.input_width = in.width; }
constexpr void add(Model &m, Loss l) { m.loss = l; }
constexpr void add(Model &m, Block b) {
  if (m.n_stages == max_stages) { ++m.stage_overflow; return; }
  m.stages[m.n_stages++] = b;
}
constexpr void add(Model &m, Layer l) {  // consecutive plain layers form one stage
  if (m.n_stages > 0) {
    Block &last = m.stages[m.n_stages - 1];
    if (!last.checkpointable && !last.residual && last.n_layers < max_block_layers) {
      last.layers[last.n_layers++] = l;
      return;
    }
  }
  add(m, sequential(l));
}
}  // namespace detail

template <class... Parts> constexpr Model make_model(Parts... parts) {
  Model m;
  (detail::add(m, parts), ...);
  return m;
}

// ---------------------------------------------------------------------------------------------
// Shape inference and checking. check() resolves inferred widths or names the first problem.
// ---------------------------------------------------------------------------------------------
struct Checked {
  Model model;
  Message error;  // empty when the model is well formed
  constexpr bool ok() const { return error.size() == 0; }
};

constexpr Checked check(Model m) {
  auto fail = [&](const Message &why) { return Checked{m, cat<Message>("remat: ", why.view())}; };
  if (m.input_width <= 0) return fail("the model needs input(width) with width >= 1");
  if (m.stage_overflow > 0) return fail(cat<Message>("a model holds at most ", max_stages, " stages"));
  if (m.n_stages == 0) return fail("the model has no layers");
  int width = m.input_width;
  for (int s = 0; s < m.n_stages; ++s) {
    Block &b = m.stages[s];
    if (b.repeat < 1) return fail(cat<Message>("stage ", s, ": repeat(n, ...) needs n >= 1, got ", b.repeat));
    if (b.n_layers == 0) return fail(cat<Message>("stage ", s, " has no layers"));
    const int block_in = width;
    for (int k = 0; k < b.n_layers; ++k) {
      Layer &l = b.layers[k];
      auto where = cat<Message>("stage ", s, " layer ", k, " (", op_name(l.op), ")");
      if (l.op == Op::linear) {
        if (l.in <= 0 || l.out <= 0)
          return fail(cat<Message>(where.view(), ": linear(", l.in, ", ", l.out, ") needs positive widths"));
        if (l.in != width)
          return fail(cat<Message>(where.view(), ": expects ", l.in, " input features but the stack carries ",
                          width));
      } else {
        if (l.in != 0 && l.in != width)
          return fail(cat<Message>(where.view(), ": declared for width ", l.in,
                          " but the stack carries ", width));
        l.in = l.out = width;
      }
      width = l.out;
    }
    if (b.residual && width != block_in)
      return fail(cat<Message>("stage ", s, ": residual block maps ", block_in, " features to ", width,
                      "; a residual block must keep its width"));
  }
  if (m.loss.classes == 0) m.loss.classes = width;
  if (m.loss.classes != width)
    return fail(cat<Message>("softmax_cross_entropy(", m.loss.classes, ") follows a stack of width ", width));
  return {m, {}};
}

// A model that failed check() does not compile; the message names the layer and the widths.
template <Model M> consteval Model checked() {
  constexpr Checked c = check(M);
  static_assert(c.ok(), c.error);
  return c.model;
}

// ---------------------------------------------------------------------------------------------
// Checkpoint policies
// ---------------------------------------------------------------------------------------------
struct Policy {
  enum class Kind : std::uint8_t { none, full, every_n_layers, sqrt_n } kind = Kind::none;
  int n = 0;  // for every_n_layers
  constexpr bool operator==(const Policy &) const = default;
};

inline constexpr Policy none{Policy::Kind::none};
inline constexpr Policy full{Policy::Kind::full};
inline constexpr Policy sqrt_n{Policy::Kind::sqrt_n};

// Blocks 0, n, 2n... are checkpointed, the others keep their internals (as in HF Transformers).
consteval Policy every_n_layers(int n) {
  if (n < 1) throw "remat: every_n_layers(n) needs n >= 1";
  return {Policy::Kind::every_n_layers, n};
}

constexpr Name policy_name(Policy p) {
  switch (p.kind) {
  case Policy::Kind::none: return "none";
  case Policy::Kind::full: return "full";
  case Policy::Kind::every_n_layers: return cat("every_n_layers=", p.n);
  case Policy::Kind::sqrt_n: return "sqrt_n";
  }
  return "?";
}

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
  switch (p.kind) {
  case Policy::Kind::none: break;
  case Policy::Kind::full:
    for (int i = 0; i < n_blocks; ++i) out.push_back({i, i});
    break;
  case Policy::Kind::every_n_layers:
    for (int i = 0; i < n_blocks; i += p.n) out.push_back({i, i});
    break;
  case Policy::Kind::sqrt_n: {  // ceil(sqrt(L)) segments of equal length (Chen et al. 2016)
    const int count = ceil_sqrt(n_blocks), length = (n_blocks + count - 1) / count;
    for (int i = 0; i < n_blocks; i += length) out.push_back({i, std::min(i + length, n_blocks) - 1});
    break;
  }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Tensors of one block, by local name. The generators name kernel arguments the same way; the
// planner binds each local name to a tensor of the arena.
//   x [B, C_in]  block input          y [B, C_out] block output
//   h<k> [B, C]  output of layer k (k < last)      mean<k>, rstd<k> [B] LayerNorm row statistics
//   p<k>_w, p<k>_b  parameters of layer k  (linear: w [K, O] row-major so y = x w + b;
//                   layer_norm: w = gamma [C], b = beta [C]);  g<k>_w, g<k>_b their gradients
// Backward scratch: dh<k> [B, C] gradient of h<k>; s<k>_1, s<k>_2 [B] LayerNorm row sums;
//                   p<k>_wt [O, K] transposed weight for the input gradient of a linear.
// ---------------------------------------------------------------------------------------------
struct LocalTensor {
  Name name;
  int dims = 2;             // 2: [B, width]; 1: [B] (width == 1); params give extents directly
  std::array<int, 2> extent{};  // extent[0] is the innermost (contiguous) dimension; -1 = B
  bool cheap = false;       // recomputable elementwise: kept in registers by recompute kernels
  bool decay = false;       // parameters: AdamW weight decay applies
  constexpr long long elements(int batch) const {
    long long n = 1;
    for (int d = 0; d < dims; ++d) n *= extent[d] < 0 ? batch : extent[d];
    return n;
  }
};

constexpr LocalTensor rows(Name name, int width, bool cheap = false) {
  return {name, 2, {width, -1}, cheap};
}
constexpr LocalTensor row_stat(Name name) { return {name, 1, {-1, 0}}; }

constexpr std::vector<LocalTensor> internals(const Block &b) {
  std::vector<LocalTensor> out;
  for (int k = 0; k < b.n_layers; ++k) {
    const Layer &l = b.layers[k];
    if (l.op == Op::layer_norm) {
      out.push_back(row_stat(cat("mean", k)));
      out.push_back(row_stat(cat("rstd", k)));
    }
    if (k + 1 < b.n_layers) out.push_back(rows(cat("h", k), l.out, cheap_to_recompute(l.op)));
  }
  return out;
}

constexpr std::vector<LocalTensor> params(const Block &b) {
  std::vector<LocalTensor> out;
  for (int k = 0; k < b.n_layers; ++k) {
    const Layer &l = b.layers[k];
    if (l.op == Op::linear) {
      out.push_back({cat("p", k, "_w"), 2, {l.out, l.in}, false, true});
      out.push_back({cat("p", k, "_b"), 1, {l.out, 0}});
    } else if (l.op == Op::layer_norm) {
      out.push_back({cat("p", k, "_w"), 1, {l.out, 0}});
      out.push_back({cat("p", k, "_b"), 1, {l.out, 0}});
    }
  }
  return out;
}

constexpr Name grad_name(const Name &param) {  // p3_w -> g3_w
  Name g = param;
  g.chars[0] = 'g';
  return g;
}

constexpr std::vector<LocalTensor> backward_scratch(const Block &b, bool needs_input_grad) {
  std::vector<LocalTensor> out;
  for (int k = 0; k < b.n_layers; ++k) {
    const Layer &l = b.layers[k];
    if (k + 1 < b.n_layers) out.push_back(rows(cat("dh", k), l.out));
    const bool grad_in = k > 0 || needs_input_grad;
    if (l.op == Op::layer_norm && grad_in) {
      out.push_back(row_stat(cat("s", k, "_1")));
      out.push_back(row_stat(cat("s", k, "_2")));
    }
    if (l.op == Op::linear && grad_in) out.push_back({cat("p", k, "_wt"), 2, {l.in, l.out}});
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Kernels and the plan
// ---------------------------------------------------------------------------------------------
enum class Variant : std::uint8_t {
  forward_save,       // writes the block output and every internal
  forward_discard,    // writes the block output; internals only as short-lived scratch
  backward_saved,     // backward from saved internals
  backward_recompute, // backward with the forward recompute fused in; takes the block input
  loss,               // softmax cross-entropy: per-row loss, correctness and logits gradient
  adamw,              // optimizer update over a flat range of parameters
};

constexpr std::string_view variant_name(Variant v) {
  switch (v) {
  case Variant::forward_save: return "forward_save";
  case Variant::forward_discard: return "forward_discard";
  case Variant::backward_saved: return "backward_saved";
  case Variant::backward_recompute: return "backward_recompute";
  case Variant::loss: return "loss";
  case Variant::adamw: return "adamw";
  }
  return "?";
}

// Kernel symbol: <model>_s<stage>_<variant>, <model>_loss, <model>_adamw.
constexpr Name kernel_name(std::string_view model, int stage, Variant v) {
  if (v == Variant::loss || v == Variant::adamw) return cat(model, "_", variant_name(v));
  return cat(model, "_s", stage, "_", variant_name(v));
}

enum class Role : std::uint8_t {
  params, grads, adam_m, adam_v,  // flat, persistent; per-layer tensors are views into them
  data,                           // batch inputs and labels, persistent
  block_input,                    // a block's input kept for its backward (or the next block)
  internal,                       // an internal saved for backward
  recomputed,                     // an internal rebuilt or discarded within recompute
  gradient,                       // gradient flowing between blocks
  scratch,                        // short-lived workspace of one backward kernel
  metrics,                        // per-row loss and correctness, persistent
};

constexpr bool is_activation(Role r) {
  return r == Role::block_input || r == Role::internal || r == Role::recomputed;
}

struct Tensor {
  Name name;        // unique: s<stage>.b<block>.<local> or a global name
  Role role{};
  int dims = 1;
  std::array<long long, 2> extent{};
  int elem_bytes = 4;
  int view_of = -1;           // for views: the root tensor and the byte offset inside it
  std::size_t offset = 0;     // roots: arena offset; views: offset inside the root
  constexpr std::size_t bytes() const {
    long long n = elem_bytes;
    for (int d = 0; d < dims; ++d) n *= extent[d];
    return std::size_t(n);
  }
};

struct Arg {
  Name name;   // the kernel argument's name
  int tensor;  // index into Plan::tensors
};

struct Step {
  int stage = -1;
  Variant variant{};
  int block = 0;  // index of the block within its stage
  bool recompute = false;  // runs forward work a second time
  std::vector<Arg> args;
  std::vector<int> alloc;  // tensors that become live before the kernel runs
  std::vector<int> free;   // tensors that die after it
};

inline constexpr std::size_t arena_alignment = 64;

struct Plan {
  std::vector<Tensor> tensors;
  std::vector<Step> train;     // one micro-batch: forward, loss, backward
  std::vector<Step> optimize;  // AdamW over the flat parameters
  std::vector<Step> eval;      // forward-discard of every stage, then the loss kernel
  std::size_t peak_bytes = 0;         // arena size: the highest byte any live tensor reaches
  std::size_t activation_bytes = 0;   // most activation bytes live at once during training
  std::size_t eval_peak_bytes = 0;
  long long param_count = 0;
  int recompute_launches = 0;         // kernels per micro-batch that recompute forward work
  int total_launches = 0;

  constexpr int find(std::string_view name) const {
    for (int i = 0; i < int(tensors.size()); ++i)
      if (tensors[i].name == name) return i;
    return -1;
  }
};

namespace detail {

// std::vector<int>(n, v) is not usable in constant expressions with libstdc++ 12 under clang.
constexpr std::vector<int> filled(std::size_t n, int value) {
  std::vector<int> v;
  v.reserve(n);
  for (std::size_t i = 0; i < n; ++i) v.push_back(value);
  return v;
}

constexpr std::size_t align_up(std::size_t v) {
  return (v + arena_alignment - 1) / arena_alignment * arena_alignment;
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
  std::string_view model_name;
  Plan plan{};

  constexpr int add(Tensor t) {
    plan.tensors.push_back(t);
    return int(plan.tensors.size()) - 1;
  }
  constexpr int activation(Name name, Role role, const LocalTensor &lt) {
    Tensor t{name, role, lt.dims};
    for (int d = 0; d < lt.dims; ++d) t.extent[d] = lt.extent[d] < 0 ? batch : lt.extent[d];
    return add(t);
  }
  constexpr void free_activation(Step &st, int t) const {  // data tensors stay
    if (plan.tensors[t].role != Role::data) st.free.push_back(t);
  }
  constexpr Name prefix(int stage, int block) const { return cat("s", stage, ".b", block, "."); }

  // Per (stage, block): tensor ids of parameters, gradients (views into the flat buffers).
  std::vector<std::vector<std::vector<Arg>>> param_args{}, grad_args{};
  int params_root = -1, grads_root = -1, m_root = -1, v_root = -1;
  long long decayed_count = 0;

  constexpr void make_params() {
    params_root = add({"params", Role::params, 1});
    grads_root = add({"grads", Role::grads, 1});
    m_root = add({"adam_m", Role::adam_m, 1});
    v_root = add({"adam_v", Role::adam_v, 1});
    param_args.resize(m.n_stages);
    grad_args.resize(m.n_stages);
    for (int s = 0; s < m.n_stages; ++s) {
      param_args[s].resize(m.stages[s].repeat);
      grad_args[s].resize(m.stages[s].repeat);
    }
    // Two passes: decayed parameters (linear weights) first, so AdamW runs on two flat ranges.
    long long count = 0;
    for (bool decayed : {true, false}) {
      for (int s = 0; s < m.n_stages; ++s)
        for (int b = 0; b < m.stages[s].repeat; ++b)
          for (const LocalTensor &lt : params(m.stages[s])) {
            if (lt.decay != decayed) continue;
            const auto n = lt.elements(batch);
            Tensor p{cat(prefix(s, b).view(), lt.name.view()), Role::params, lt.dims};
            for (int d = 0; d < lt.dims; ++d) p.extent[d] = lt.extent[d];
            p.view_of = params_root;
            p.offset = std::size_t(count) * 4;
            Tensor g = p;
            g.name = cat(prefix(s, b).view(), grad_name(lt.name).view());
            g.role = Role::grads;
            g.view_of = grads_root;
            param_args[s][b].push_back({lt.name, add(p)});
            grad_args[s][b].push_back({grad_name(lt.name), add(g)});
            count += n;
          }
      if (decayed) decayed_count = count;
    }
    plan.param_count = count;
    for (int r : {params_root, grads_root, m_root, v_root}) plan.tensors[r].extent[0] = count;
  }

  constexpr Step step(int stage, Variant v, int block) const {
    Step st;
    st.stage = stage;
    st.variant = v;
    st.block = block;
    return st;
  }
  constexpr void bind_params(Step &st, bool grads) const {
    for (const Arg &a : param_args[st.stage][st.block]) st.args.push_back(a);
    if (grads)
      for (const Arg &a : grad_args[st.stage][st.block]) {
        st.args.push_back(a);
        st.args.push_back({cat(a.name.view(), "_prev"), a.tensor});  // accumulated in place
      }
  }

  // Forward of one block. Returns the output tensor. Internals get `role` when kept, or are
  // freed right after the kernel when `keep` is false.
  constexpr int forward(std::vector<Step> &out, int s, int b, int x, bool keep, Role role,
                        std::vector<int> *kept) {
    const Block &blk = m.stages[s];
    Step st = step(s, keep ? Variant::forward_save : Variant::forward_discard, b);
    const int y = activation(cat(prefix(s, b).view(), "y"), Role::block_input,
                             rows("y", blk.out()));
    st.alloc.push_back(y);
    st.args.push_back({"x", x});
    st.args.push_back({"y", y});
    bind_params(st, false);
    for (const LocalTensor &lt : internals(blk)) {
      if (!keep && lt.cheap) continue;  // stays in registers
      const int t = activation(cat(prefix(s, b).view(), lt.name.view()),
                               keep ? role : Role::recomputed, lt);
      st.alloc.push_back(t);
      st.args.push_back({lt.name, t});
      if (keep) kept->push_back(t);
      else st.free.push_back(t);
    }
    out.push_back(st);
    return y;
  }

  // Backward of one block: consumes dy, produces dx (unless it is the model's first stage).
  constexpr int backward(std::vector<Step> &out, int s, int b, int x, int dy,
                         const std::vector<int> &saved, bool recompute) {
    const Block &blk = m.stages[s];
    const bool needs_dx = s > 0;
    Step st = step(s, recompute ? Variant::backward_recompute : Variant::backward_saved, b);
    st.recompute = recompute;
    int dx = -1;
    if (needs_dx) {
      dx = activation(cat(prefix(s, b).view(), "dx"), Role::gradient, rows("dx", blk.in()));
      st.alloc.push_back(dx);
      st.args.push_back({"dx", dx});
    }
    st.args.push_back({"x", x});
    st.args.push_back({"dy", dy});
    bind_params(st, true);
    if (recompute) {
      for (const LocalTensor &lt : internals(blk)) {
        if (lt.cheap) continue;
        const int t = activation(cat(prefix(s, b).view(), lt.name.view()), Role::recomputed, lt);
        st.alloc.push_back(t);
        st.args.push_back({lt.name, t});
        st.free.push_back(t);
      }
    } else {
      for (int t : saved) {
        const Name &full = plan.tensors[t].name;
        const auto local = full.view().substr(prefix(s, b).size());
        st.args.push_back({Name{}.append(local), t});
        st.free.push_back(t);
      }
    }
    for (const LocalTensor &lt : backward_scratch(blk, needs_dx)) {
      const int t = activation(cat(prefix(s, b).view(), lt.name.view()), Role::scratch, lt);
      st.alloc.push_back(t);
      st.args.push_back({lt.name, t});
      st.free.push_back(t);
    }
    st.free.push_back(dy);
    out.push_back(st);
    return dx;
  }

  constexpr void build() {
    make_params();
    const int images = add({"images", Role::data, 2, {m.input_width, batch}});
    const int labels = add({"labels", Role::data, 1, {batch, 0}});
    const int row_loss = add({"row_loss", Role::metrics, 1, {batch, 0}});
    const int row_correct = add({"row_correct", Role::metrics, 1, {batch, 0}});
    const int row_max = add({"row_max", Role::metrics, 1, {batch, 0}});
    const int row_lse = add({"row_lse", Role::metrics, 1, {batch, 0}});

    // Blocks in order, with global checkpointable index (-1 for plain stages).
    struct Unit { int stage, block, index; };
    std::vector<Unit> units;
    int index = 0;
    for (int s = 0; s < m.n_stages; ++s)
      for (int b = 0; b < m.stages[s].repeat; ++b)
        units.push_back({s, b, m.stages[s].checkpointable ? index++ : -1});
    const std::vector<Segment> segs = segments(policy, m.n_blocks());
    auto segment_of = [&](int i) -> int {
      for (int k = 0; k < int(segs.size()); ++k)
        if (i >= 0 && segs[k].first <= i && i <= segs[k].last) return k;
      return -1;
    };

    // ---- forward ----
    std::vector<int> inputs = filled(units.size(), -1);
    std::vector<std::vector<int>> saved(units.size());
    int x = images;
    for (int u = 0; u < int(units.size()); ++u) {
      const int seg = segment_of(units[u].index);
      inputs[u] = x;
      const int y = forward(plan.train, units[u].stage, units[u].block, x, seg < 0,
                            Role::internal, &saved[u]);
      // The input stays if this block's backward reads it or it starts a segment.
      const bool input_kept = seg < 0 || segs[seg].first == units[u].index;
      if (!input_kept) free_activation(plan.train.back(), x);
      x = y;
    }
    // ---- loss ----
    Step loss = step(-1, Variant::loss, 0);
    const int dlogits = activation("dlogits", Role::gradient, rows("dlogits", m.classes()));
    loss.alloc.push_back(dlogits);
    loss.args = {{"logits", x}, {"labels", labels}, {"dlogits", dlogits},
                 {"row_loss", row_loss}, {"row_correct", row_correct},
                 {"row_max", row_max}, {"row_lse", row_lse}};
    loss.free.push_back(x);
    plan.train.push_back(loss);
    // ---- backward ----
    int dy = dlogits;
    for (int u = int(units.size()) - 1; u >= 0; --u) {
      const int seg = segment_of(units[u].index);
      const auto [s, b, i] = units[u];
      if (seg < 0) {
        dy = backward(plan.train, s, b, inputs[u], dy, saved[u], false);
        free_activation(plan.train.back(), inputs[u]);
        continue;
      }
      // Last block of a segment: rebuild the inputs and internals of the segment's earlier
      // blocks, then run this block's fused recompute-backward, then the others from saved.
      const int first = u - (i - segs[seg].first);
      std::vector<int> rebuilt_inputs = filled(units.size(), -1);
      rebuilt_inputs[first] = inputs[first];
      std::vector<std::vector<int>> rebuilt(units.size());
      for (int r = first; r < u; ++r) {
        const int y = forward(plan.train, units[r].stage, units[r].block, rebuilt_inputs[r], true,
                              Role::recomputed, &rebuilt[r]);
        plan.train.back().recompute = true;
        // the rebuilt output is recomputed, not a kept block input
        plan.tensors[y].role = Role::recomputed;
        rebuilt_inputs[r + 1] = y;
      }
      for (int r = u; r >= first; --r) {
        dy = backward(plan.train, units[r].stage, units[r].block, rebuilt_inputs[r], dy,
                      rebuilt[r], r == u);
        free_activation(plan.train.back(), rebuilt_inputs[r]);
      }
      u = first;
    }
    // ---- optimizer: decayed parameters, then the rest ----
    for (bool decayed : {true, false}) {
      const long long begin = decayed ? 0 : decayed_count;
      const long long end = decayed ? decayed_count : plan.param_count;
      if (begin == end) continue;
      Step st = step(-1, Variant::adamw, decayed ? 0 : 1);
      for (auto [name, root] : {std::pair{"p", params_root}, {"g", grads_root},
                                {"m", m_root}, {"v", v_root}}) {
        Tensor view{cat(name, decayed ? "_decayed" : "_plain"), plan.tensors[root].role, 1,
                    {end - begin, 0}};
        view.view_of = root;
        view.offset = std::size_t(begin) * 4;
        st.args.push_back({name, add(view)});
      }
      // The kernel's Tuple output {p, m, v} is written in place over its inputs.
      for (auto [out, in] : {std::pair{"adamw.0", 0}, {"adamw.1", 2}, {"adamw.2", 3}})
        st.args.push_back({out, st.args[in].tensor});
      plan.optimize.push_back(st);
    }
    // ---- evaluation: forward-discard of every block, then the loss kernel ----
    x = images;
    for (const Unit &unit : units) {
      const int y = forward(plan.eval, unit.stage, unit.block, x, false, Role::internal, nullptr);
      free_activation(plan.eval.back(), x);
      x = y;
    }
    Step eval_loss = loss;
    const int eval_dlogits = activation("eval_dlogits", Role::gradient, rows("d", m.classes()));
    eval_loss.alloc = {eval_dlogits};
    eval_loss.args[0].tensor = x;
    eval_loss.args[2].tensor = eval_dlogits;
    eval_loss.free = {x, eval_dlogits};
    plan.eval.push_back(eval_loss);

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
    // The eval schedule is placed first so training's placement (the one measured) wins where a
    // tensor appears in both (images, dlogits); eval reuses training's offsets for those.
    plan.eval_peak_bytes = run(plan.eval, false);
    plan.peak_bytes = run(plan.train, true);
    for (const Step &st : plan.train) {
      plan.total_launches += 1;
      plan.recompute_launches += st.recompute ? 1 : 0;
    }
  }
};

}  // namespace detail

// The plan for one micro-batch of `batch` rows under `policy`. Runs at compile time for a
// policy fixed in the model module and at run time for one chosen by a flag.
constexpr Plan make_plan(const Model &m, Policy policy, int batch, std::string_view model_name) {
  detail::Builder builder{m, policy, batch, model_name};
  builder.build();
  return std::move(builder.plan);
}

}  // namespace remat
