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
// Layers and their kinds
// ---------------------------------------------------------------------------------------------
enum class Op : std::uint8_t {
  linear, layer_norm, rms_norm, gelu, relu, swiglu, dropout, rope, attention, embedding, residual_begin, residual_end
};
inline constexpr int n_ops = 12;

// A layer maps C_in features to C_out features per row. 0 means "inferred from the stack".
struct Layer {
  Op op{};
  int in = 0;
  int out = 0;
  int heads = 0;       // attention, rope: query heads
  int kv_heads = 0;    // attention, rope: key / value heads (a divisor of heads; fewer: grouped-query)
  int vocab = 0;       // embedding
  int block_size = 0;  // attention, embedding: T, the rows of one sequence (from the input)
  bool bias = true;    // linear: y = x w + b (false: y = x w); embedding: a position table
};

// The dimensions of a layer's tensors, in terms of the layer.
enum class Dim : std::uint8_t { none, rows, in, out, vocab, block_size, heads };
constexpr long long dim_of(const Layer &l, Dim d) {
  switch (d) {
  case Dim::none: return 0;
  case Dim::rows: return -1;
  case Dim::in: return l.in;
  case Dim::out: return l.out;
  case Dim::vocab: return l.vocab;
  case Dim::block_size: return l.block_size;
  case Dim::heads: return l.heads;
  }
  return 0;
}
// How a parameter starts. uniform_fan_in: U(-1/sqrt(n), 1/sqrt(n)) with n its extent[1] (a
// linear's input width, as PyTorch; an embedding table's rows).
enum class Init : std::uint8_t { zeros, ones, uniform_fan_in };
// When a tensor of a kind exists.
enum class When : std::uint8_t { always, with_bias, with_input_grad };

// One tensor of a kind, named <stem><layer index><suffix> (p3_w, mean2, att4_lse).
struct TensorRule {
  std::string_view stem, suffix;  // empty stem: no tensor
  int dims = 1;
  std::array<Dim, 2> extent{};    // extent[0] is the innermost (contiguous) dimension
  Init init = Init::zeros;        // parameters
  bool decay = false;             // parameters: AdamW weight decay applies
  When when = When::always;
};
using TensorRules = std::array<TensorRule, 2>;

// What shape inference gives a kind: the stack's width before the layer, whether it is the
// model's first layer, and the input (token models: vocab, block_size).
struct ShapeContext {
  int width = 0;
  bool first = false;
  int vocab = 0, block_size = 0;  // 0: feature rows
};

// Everything the planner, the model compiler, the executor, the trainer, the plan report and the
// tests know about a kind of layer, in one entry (the kernels' rules live in generators/: one
// unit per kind, dispatched by Op).
struct Kind {
  Op op{};
  std::string_view name;
  // Resolves l.in / l.out (and what else the layer takes from the model) from the stack, or says
  // what is wrong (the caller prefixes the layer's position).
  Message (*infer)(Layer &l, const ShapeContext &c) = nullptr;
  bool reads_input = false;   // its backward reads its input
  bool reads_output = false;  // ... and its own output (so it cannot end a block)
  // Its output is a buffer of its own where it is computed (GEMM, GELU, attention); otherwise it
  // is rebuilt elementwise where it is read (unless the planner buffers it for a GEMM).
  bool buffered = false;
  bool recomputed_by_selective = false;  // what Megatron-style selective recomputes in backward
  bool gemm = false;        // y = x w (+ b): GEMM weight copies, starts an epilogue chain
  bool chain_link = false;  // elementwise on its source, continues an epilogue chain (dropout, residual sum)
  bool draws_masks = false; // reads the dropout counters (seed, step, block)
  bool repeatable = true;
  TensorRules params{};     // parameters, their gradients g<k>_<suffix>
  TensorRules stats{};      // row statistics forward writes and backward reads
  TensorRules workspace{};  // backward's own short-lived buffers
  // Forward arithmetic per row, multiply-adds counted as two: GEMMs and attention products
  // (what REMAT_PROFILE divides by time; elementwise work is left out). nullptr: none.
  double (*flops)(const Layer &l) = nullptr;
  double backward_flops = 0;  // backward's arithmetic per forward flop
};

namespace kinds {
constexpr Message keeps_width(Layer &l, const ShapeContext &c) {
  if (l.in != 0 && l.in != c.width) return cat<Message>("declared for width ", l.in, " but the stack carries ", c.width);
  l.in = l.out = c.width;
  return {};
}
constexpr Message linear_shape(Layer &l, const ShapeContext &c) {
  if (l.in <= 0 || l.out <= 0) return cat<Message>("linear(", l.in, ", ", l.out, ") needs positive widths");
  if (l.in != c.width) return cat<Message>("expects ", l.in, " input features but the stack carries ", c.width);
  return {};
}
constexpr Message halves_width(Layer &l, const ShapeContext &c) {
  if (c.width % 2 != 0) return cat<Message>("expects [gate | up] (2H features) but the stack carries ", c.width);
  l.in = c.width;
  l.out = c.width / 2;
  return {};
}
constexpr Message rope_shape(Layer &l, const ShapeContext &c) {
  if (c.block_size == 0) return "rope needs sequences: tokens(vocab, block_size)";
  if (l.heads < 1 || l.kv_heads < 1 || l.heads % l.kv_heads != 0)
    return cat<Message>("rope(", l.heads, ", ", l.kv_heads, ") needs heads >= 1 and kv_heads dividing them");
  const int parts = l.heads + 2 * l.kv_heads;
  if (c.width % parts != 0 || (c.width / parts) % 2 != 0)
    return cat<Message>("expects [q | k | v] of ", l.heads, " + 2 x ", l.kv_heads, " heads of an even width but the stack carries ",
                        c.width);
  l.in = l.out = c.width;
  l.block_size = c.block_size;
  return {};
}
constexpr Message embedding_shape(Layer &l, const ShapeContext &c) {
  if (!c.first || c.block_size == 0) return "an embedding must be the first layer, after tokens(vocab, block_size)";
  if (l.vocab != c.vocab) return cat<Message>("embedding(", l.vocab, ", ...) but tokens(", c.vocab, ", ...)");
  if (l.out <= 0) return "needs a positive width";
  l.block_size = c.block_size;
  return {};
}
constexpr Message attention_shape(Layer &l, const ShapeContext &c) {
  if (c.block_size == 0) return "attention needs sequences: tokens(vocab, block_size)";
  if (l.kv_heads == l.heads) {  // multi-head: [q | k | v] of C each
    if (c.width % 3 != 0) return cat<Message>("expects fused q, k, v (3C features) but the stack carries ", c.width);
    if (l.heads < 1 || (c.width / 3) % l.heads != 0)
      return cat<Message>(l.heads, " heads do not divide the width ", c.width / 3);
  } else {  // grouped-query: q of heads x D, k and v of kv_heads x D each
    if (l.kv_heads < 1 || l.heads % l.kv_heads != 0)
      return cat<Message>(l.kv_heads, " kv_heads do not divide the ", l.heads, " heads");
    if (c.width % (l.heads + 2 * l.kv_heads) != 0)
      return cat<Message>("expects fused q, k, v of ", l.heads, " + 2 x ", l.kv_heads, " heads but the stack carries ", c.width);
  }
  l.in = c.width;
  l.out = c.width / (l.heads + 2 * l.kv_heads) * l.heads;
  l.block_size = c.block_size;
  return {};
}
constexpr double gemm_flops(const Layer &l) { return 2.0 * l.in * l.out; }
// causal: q k^T and p v over (T + 1) / 2 keys on average
constexpr double attention_flops(const Layer &l) { return 2.0 * (l.block_size + 1) * l.out; }

constexpr TensorRule row_statistic(std::string_view stem, std::string_view suffix = {}, When when = When::always) {
  return {stem, suffix, 1, {Dim::rows, Dim::none}, Init::zeros, false, when};
}
constexpr TensorRule head_statistic(std::string_view stem, std::string_view suffix) {
  return {stem, suffix, 2, {Dim::heads, Dim::rows}};
}

inline constexpr std::array<Kind, n_ops> table = {{
    {.op = Op::linear, .name = "linear", .infer = linear_shape, .reads_input = true, .buffered = true, .gemm = true,
     // w [K, O] row-major (y = x w + b), b [O]
     .params = {{{"p", "_w", 2, {Dim::out, Dim::in}, Init::uniform_fan_in, true},
                 {"p", "_b", 1, {Dim::out, Dim::none}, Init::zeros, false, When::with_bias}}},
     .flops = gemm_flops, .backward_flops = 2},  // dx and dW
    {.op = Op::layer_norm, .name = "layer_norm", .infer = keeps_width, .reads_input = true,
     .params = {{{"p", "_w", 1, {Dim::out, Dim::none}, Init::ones}, {"p", "_b", 1, {Dim::out, Dim::none}, Init::zeros}}},
     .stats = {{row_statistic("mean"), row_statistic("rstd")}},
     .workspace = {{row_statistic("s", "_1", When::with_input_grad), row_statistic("s", "_2", When::with_input_grad)}}},
    {.op = Op::rms_norm, .name = "rms_norm", .infer = keeps_width, .reads_input = true,
     .params = {{{"p", "_w", 1, {Dim::out, Dim::none}, Init::ones}}},
     .stats = {{row_statistic("rstd")}},
     .workspace = {{row_statistic("s", "_1", When::with_input_grad)}}},
    {.op = Op::gelu, .name = "gelu", .infer = keeps_width, .reads_input = true, .buffered = true,
     .recomputed_by_selective = true},
    {.op = Op::relu, .name = "relu", .infer = keeps_width, .reads_input = true},
    {.op = Op::swiglu, .name = "swiglu", .infer = halves_width, .reads_input = true, .buffered = true,
     .recomputed_by_selective = true},
    // Inverted dropout: the mask is a counter-based hash of (seed, step, block, element), so a
    // recompute draws the same mask without saving it.
    {.op = Op::dropout, .name = "dropout", .infer = keeps_width, .chain_link = true, .draws_masks = true},
    // Rotary position embedding on the q and k heads of a fused [q | k | v] row; v passes. Its
    // backward (the inverse rotation) reads nothing; its output is buffered, and the attention
    // after it reads that.
    {.op = Op::rope, .name = "rope", .infer = rope_shape, .buffered = true},
    {.op = Op::attention, .name = "causal_self_attention", .infer = attention_shape, .reads_input = true,
     .reads_output = true, .buffered = true, .recomputed_by_selective = true, .draws_masks = true,
     .stats = {{head_statistic("att", "_lse")}}, .workspace = {{head_statistic("att", "_delta")}},
     // backward rebuilds p and forms dp, dv, dq and dk: 5 products of the forward's 2
     .flops = attention_flops, .backward_flops = 2.5},
    // token table [V, C], positions [T, C]
    {.op = Op::embedding, .name = "embedding", .infer = embedding_shape, .repeatable = false,
     .params = {{{"p", "_w", 2, {Dim::out, Dim::vocab}, Init::uniform_fan_in},
                 {"p", "_b", 2, {Dim::out, Dim::block_size}, Init::uniform_fan_in, false, When::with_bias}}}},
    {.op = Op::residual_begin, .name = "residual(", .infer = keeps_width},
    {.op = Op::residual_end, .name = "residual sum", .infer = keeps_width, .chain_link = true},
}};
static_assert([] {
  for (int i = 0; i < n_ops; ++i)
    if (int(table[i].op) != i) return false;
  return true;
}(), "remat: the kinds table is indexed by Op");
}  // namespace kinds

constexpr const Kind &kind(Op op) { return kinds::table[std::size_t(op)]; }
constexpr std::string_view op_name(Op op) { return kind(op).name; }
// Whether a tensor rule applies to layer l (a bias only when the linear has one).
constexpr bool present(const TensorRule &r, const Layer &l, bool input_grad = true) {
  if (r.stem.empty()) return false;
  return r.when == When::always || (r.when == When::with_bias && l.bias) || (r.when == When::with_input_grad && input_grad);
}

constexpr Layer linear(int in, int out) { return {Op::linear, in, out}; }
// A linear without bias (y = x w), as in Llama-style models.
struct NoBias {};
inline constexpr NoBias no_bias{};
constexpr Layer linear(int in, int out, NoBias) { return {.op = Op::linear, .in = in, .out = out, .bias = false}; }
constexpr Layer layer_norm(int width = 0) { return {Op::layer_norm, width, width}; }
// RMSNorm (Llama): x / sqrt(mean(x^2) + 1e-6) * gamma, no bias.
constexpr Layer rms_norm(int width = 0) { return {Op::rms_norm, width, width}; }
constexpr Layer gelu() { return {Op::gelu}; }
constexpr Layer relu() { return {Op::relu}; }
// The gate of a gated MLP: [a | b] (2H features) in, silu(a) * b (H) out, as in
// linear(C, 2H) -> swiglu -> linear(H, C).
constexpr Layer swiglu() { return {Op::swiglu}; }
// Inverted dropout; the probability is a run-time value (--dropout).
constexpr Layer dropout() { return {Op::dropout}; }
// Causal multi-head self-attention core on fused [q | k | v] features (3C in, C out). With
// kv_heads < heads, grouped-query attention: [q | k | v] of (heads + 2 kv_heads) D features in,
// heads D out, query head h reading key / value head h / (heads / kv_heads).
constexpr Layer causal_self_attention(int heads, int kv_heads = 0) {
  return {.op = Op::attention, .heads = heads, .kv_heads = kv_heads == 0 ? heads : kv_heads};
}
// Token + position embedding: token ids in, `width` features out.
constexpr Layer embedding(int vocab, int width) { return {Op::embedding, 1, width, 0, 0, vocab}; }
// Token embedding only (positions come from rope inside the blocks, as in Llama).
constexpr Layer token_embedding(int vocab, int width) {
  return {.op = Op::embedding, .in = 1, .out = width, .vocab = vocab, .bias = false};
}
// Rotary position embedding (the rotate-half form of Llama and GPT-NeoX, base 10000) of the
// queries and keys in a fused [q | k | v] row of heads + 2 kv_heads heads: put it between the
// q/k/v projection and the attention.
constexpr Layer rope(int heads, int kv_heads = 0) {
  return {.op = Op::rope, .heads = heads, .kv_heads = kv_heads == 0 ? heads : kv_heads};
}

inline constexpr int max_block_layers = 16;

// A block: the repeated unit of a stack. Stages made of loose layers are blocks too (repeat 1),
// but only blocks of a `repeat` stage are counted by checkpoint policies.
struct Block {
  std::array<Layer, max_block_layers> layers{};
  int n_layers = 0;
  int repeat = 1;
  bool checkpointable = false;  // true for repeat(n, ...) stages
  bool loose = false;           // made of loose layers given to make_model
  int overflow = 0;             // layers past max_block_layers, reported by check()

  constexpr int in() const { return layers[0].in; }
  constexpr int out() const { return layers[n_layers - 1].out; }
  constexpr void push(const Layer &l) {
    if (n_layers == max_block_layers) ++overflow;
    else layers[n_layers++] = l;
  }
  // The layer whose output is layer k's input; -1: the block input. residual( is transparent.
  constexpr int source(int k) const {
    int j = k - 1;
    while (j >= 0 && layers[j].op == Op::residual_begin) --j;
    return j;
  }
  // For a )residual at k: the source of its matching residual(, added back to the branch.
  constexpr int skip_source(int k) const {
    int depth = 0;
    for (int j = k - 1; j >= 0; --j) {
      if (layers[j].op == Op::residual_end) ++depth;
      if (layers[j].op == Op::residual_begin && depth-- == 0) return source(j);
    }
    return -1;
  }
  constexpr bool produces(int k) const { return layers[k].op != Op::residual_begin; }
};

constexpr Block chain_one(Block acc, const Block &b) {
  for (int k = 0; k < b.n_layers; ++k) acc.push(b.layers[k]);
  acc.overflow += b.overflow;
  return acc;
}
constexpr Block chain_one(Block acc, const Layer &l) {
  acc.push(l);
  return acc;
}
// residual(f...) computes x + f(x).
template <class... L> constexpr Block residual(L... layers) {
  Block b;
  b.push({Op::residual_begin});
  (b.push(layers), ...);
  b.push({Op::residual_end});
  return b;
}
// Blocks and layers one after the other, as one block (e.g. a transformer block: two residual
// branches; or plain layers, a block without a residual).
template <class... B> constexpr Block chain(B... blocks) {
  Block out;
  ((out = chain_one(out, blocks)), ...);
  return out;
}
constexpr Block repeat(int n, Block b) {
  b.repeat = n;
  b.checkpointable = true;
  return b;
}

// Model inputs: feature rows, or token ids with `block_size` rows per sequence.
struct Input { int width = 0; int vocab = 0; int block_size = 0; };
constexpr Input input(int width) { return {width}; }
constexpr Input tokens(int vocab, int block_size) { return {1, vocab == 0 ? -1 : vocab, block_size}; }

struct Loss { int classes = 0; };
constexpr Loss softmax_cross_entropy(int classes = 0) { return {classes}; }

inline constexpr int max_stages = 6;

struct Model {
  Input input{};
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
  constexpr bool token_input() const { return input.block_size > 0; }
  constexpr int rows_per_sample() const { return token_input() ? input.block_size : 1; }
};

namespace detail {
constexpr void add(Model &m, Input in) { m.input = in; }
constexpr void add(Model &m, Loss l) { m.loss = l; }
constexpr void add(Model &m, Block b) {
  if (m.n_stages == max_stages) { ++m.stage_overflow; return; }
  m.stages[m.n_stages++] = b;
}
constexpr void add(Model &m, Layer l) {  // consecutive loose layers form one stage
  if (m.n_stages == 0 || !m.stages[m.n_stages - 1].loose) {
    Block b;
    b.loose = true;
    add(m, b);
    if (m.stage_overflow) return;
  }
  m.stages[m.n_stages - 1].push(l);
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
  if (m.input.width <= 0) return fail("the model needs input(width) or tokens(vocab, block_size)");
  if (m.input.vocab != 0 && (m.input.vocab <= 0 || m.input.block_size <= 0))
    return fail("tokens(vocab, block_size) needs vocab >= 1 and block_size >= 1");
  if (m.stage_overflow > 0) return fail(cat<Message>("a model holds at most ", max_stages, " stages"));
  if (m.n_stages == 0) return fail("the model has no layers");
  int width = m.input.width;
  for (int s = 0; s < m.n_stages; ++s) {
    Block &b = m.stages[s];
    if (b.overflow > 0) return fail(cat<Message>("stage ", s, " has more than ", max_block_layers, " layers"));
    if (b.repeat < 1) return fail(cat<Message>("stage ", s, ": repeat(n, ...) needs n >= 1, got ", b.repeat));
    if (b.n_layers == 0) return fail(cat<Message>("stage ", s, " has no layers"));
    const int block_in = width;
    int open[max_block_layers]{}, depth = 0, written = 0;  // messages count the layers as written
    for (int k = 0; k < b.n_layers; ++k) {
      Layer &l = b.layers[k];
      const bool marker = l.op == Op::residual_begin || l.op == Op::residual_end;
      const auto where = cat<Message>("stage ", s, " layer ", written, " (", op_name(l.op), ")");
      written += !marker;
      const bool first = s == 0 && k == 0;
      const Kind &kd = kind(l.op);
      if (l.op == Op::residual_begin) {
        open[depth++] = width;
      } else if (l.op == Op::residual_end && open[--depth] != width) {
        return fail(cat<Message>("stage ", s, ": residual block maps ", open[depth], " features to ", width,
                                 "; a residual block must keep its width"));
      }
      const Message wrong = kd.infer(l, {width, first, m.input.vocab, m.input.block_size});
      if (wrong.size() > 0) return fail(cat<Message>(where, ": ", wrong));
      if (m.token_input() && first && l.op != Op::embedding)
        return fail("a token model starts with embedding(vocab, width)");
      if (!kd.repeatable && b.repeat > 1)
        return fail(cat<Message>(where, ": cannot be repeated"));
      if (kd.reads_output && k + 1 == b.n_layers)
        return fail(cat<Message>(where, ": cannot end a block (its backward reads its output)"));
      width = l.out;
    }
    if (b.repeat > 1 && width != block_in)
      return fail(cat<Message>("stage ", s, ": repeat(", b.repeat, ", ...) needs a block that keeps its width, but it maps ",
                               block_in, " features to ", width));
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
  enum class Kind : std::uint8_t { none, full, every_n_layers, sqrt_n, selective } kind = Kind::none;
  int n = 0;  // for every_n_layers
  // The checkpoints (inputs kept by segments that recompute) wait in pinned host memory between
  // their forward and backward: copied out after the block's forward, brought back one block
  // ahead of the backward that reads them.
  bool offload = false;
  constexpr bool operator==(const Policy &) const = default;
};
constexpr Policy with_offload(Policy p) {
  p.offload = true;
  return p;
}

inline constexpr Policy none{Policy::Kind::none};
inline constexpr Policy full{Policy::Kind::full};
inline constexpr Policy sqrt_n{Policy::Kind::sqrt_n};
// Megatron-style: every block saves what its backward reads except the attention core, the GELU
// and cheap elementwise values, which its backward kernel recomputes.
inline constexpr Policy selective{Policy::Kind::selective};

// Blocks 0, n, 2n... are checkpointed, the others keep their internals (as in HF Transformers).
consteval Policy every_n_layers(int n) {
  if (n < 1) throw "remat: every_n_layers(n) needs n >= 1";
  return {Policy::Kind::every_n_layers, n};
}

// Whether a stage's backward computes the gradient of its block input: every stage but the
// model's first, and the first too when it is repeated (its later blocks feed each other).
constexpr bool needs_input_grad(const Model &m, int stage) { return stage > 0 || m.stages[0].repeat > 1; }

constexpr Name policy_name(Policy p) {
  const std::string_view offload = p.offload ? "+offload" : "";
  switch (p.kind) {
  case Policy::Kind::none: return cat("none", offload);
  case Policy::Kind::full: return cat("full", offload);
  case Policy::Kind::every_n_layers: return cat("every_n_layers=", p.n, offload);
  case Policy::Kind::sqrt_n: return cat("sqrt_n", offload);
  case Policy::Kind::selective: return cat("selective", offload);
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

// What a block's forward keeps for its backward.
enum class Keep : std::uint8_t {
  all,        // everything backward reads
  selective,  // all but what recomputed_by_selective() rebuilds
  nothing,    // only the block input is kept elsewhere; backward recomputes everything
};

// ---------------------------------------------------------------------------------------------
// Tensors of one block, by local name. The generators name kernel arguments the same way; the
// planner binds each local name to a tensor of the arena. R = rows (B samples x rows per sample).
//   x [R, C_in]  block input (token ids [R] for an embedding)     y [R, C_out] block output
//   h<k> [R, C]  output of layer k (k < last)
//   mean<k>, rstd<k> [R] LayerNorm row statistics;   att<k>_lse [R, H] attention log-sum-exp
//   p<k>_w, p<k>_b  parameters of layer k (linear: w [K, O] row-major so y = x w + b;
//                   layer_norm: gamma, beta [C]; embedding: token table [V, C], positions [T, C])
//   g<k>_w, g<k>_b  their gradients
// Backward workspace: dh<k> [R, C] gradient of h<k>; s<k>_1, s<k>_2 [R] LayerNorm row sums;
//   p<k>_wt [O, K] transposed weight for the input gradient of a linear; att<k>_delta [R, H].
// ---------------------------------------------------------------------------------------------
struct LocalTensor {
  // activation: values and gradients of the data flowing through the layers (bf16 in a bf16
  // plan); statistic: per-row sums, LayerNorm and attention statistics; parameter: weights and
  // their gradients. Statistics and parameters are always fp32.
  enum class Kind : std::uint8_t { activation, statistic, parameter };
  Name name;
  int dims = 2;                 // extent[0] is the innermost (contiguous) dimension
  std::array<int, 2> extent{};  // -1: the row count R
  int layer = -1;               // the layer that produces it (-1: none)
  bool decay = false;           // parameters: AdamW weight decay applies
  Kind kind = Kind::activation;
  Init init = Init::zeros;      // parameters: how the trainer starts them
  constexpr long long elements(long long rows) const {
    long long n = 1;
    for (int d = 0; d < dims; ++d) n *= extent[d] < 0 ? rows : extent[d];
    return n;
  }
};

constexpr LocalTensor rows(Name name, int width, int layer = -1) { return {name, 2, {width, -1}, layer}; }
constexpr LocalTensor row_stat(Name name, int layer = -1) {
  return {name, 1, {-1, 0}, layer, false, LocalTensor::Kind::statistic};
}
// Attention statistics [R, H] (log-sum-exp, and delta in backward).
constexpr LocalTensor head_stat(Name name, int heads, int layer = -1) {
  return {name, 2, {heads, -1}, layer, false, LocalTensor::Kind::statistic};
}

// Precision of a plan and its kernels. bf16: activations, their gradients and GEMM operands are
// bf16 (every layer output is rounded to bf16 where it is computed, so a recompute rounds the
// same way); GEMMs and reductions accumulate in fp32; parameters, their gradients, the AdamW
// moments and all statistics stay fp32.
enum class Precision : std::uint8_t { fp32, bf16 };
constexpr std::string_view precision_name(Precision p) { return p == Precision::bf16 ? "bf16" : "fp32"; }
constexpr int element_bytes(const LocalTensor &lt, Precision p) {
  return p == Precision::bf16 && lt.kind == LocalTensor::Kind::activation ? 2 : 4;
}

constexpr LocalTensor output_of(const Block &b, int k) { return rows(cat("h", k), b.layers[k].out, k); }

// The tensor a kind's rule describes, for layer k of block b.
constexpr LocalTensor tensor_of(const TensorRule &r, const Block &b, int k, LocalTensor::Kind kind) {
  const Layer &l = b.layers[k];
  LocalTensor t{cat(r.stem, k, r.suffix), r.dims, {}, k, r.decay, kind, r.init};
  for (int d = 0; d < r.dims; ++d) t.extent[d] = int(dim_of(l, r.extent[d]));
  return t;
}
constexpr void add_tensors(std::vector<LocalTensor> &to, const TensorRules &rules, const Block &b, int k,
                           LocalTensor::Kind kind, bool input_grad = true) {
  for (const TensorRule &r : rules)
    if (present(r, b.layers[k], input_grad)) to.push_back(tensor_of(r, b, k, kind));
}

constexpr std::vector<LocalTensor> stats_of(const Block &b, int k) {
  std::vector<LocalTensor> out;
  add_tensors(out, kind(b.layers[k].op).stats, b, k, LocalTensor::Kind::statistic);
  return out;
}

// Outputs of layers before the last (the last one's output is y).
constexpr bool is_internal(const Block &b, int k) { return k + 1 < b.n_layers && b.produces(k); }

// How many layers read output j (as their input, or as the skip of a residual).
constexpr int consumers(const Block &b, int j) {
  int n = 0;
  for (int k = j + 1; k < b.n_layers; ++k)
    n += (b.produces(k) && b.source(k) == j) + (b.layers[k].op == Op::residual_end && b.skip_source(k) == j);
  return n;
}

// Backward reads output j: a later layer's rule reads its input j, or j's own rule reads its
// output (attention).
constexpr bool read_by_backward(const Block &b, int j) {
  if (!is_internal(b, j)) return false;
  if (kind(b.layers[j].op).reads_output) return true;
  for (int k = j + 1; k < b.n_layers; ++k)
    if (b.source(k) == j && kind(b.layers[k].op).reads_input) return true;
  return false;
}

// Where the GEMMs of linear layers run. halide: Halide GEMMs inside the kernels, with fused
// epilogues and operands computed per tile (the CPU's bf16 kernels). library: extern stages
// calling a GEMM library (MKL on the CPU in fp32, cuBLASLt on CUDA, a host GEMM for the OpenCL
// test build), whose operands and results are buffers and whose only epilogue is the bias. The
// plans differ: a library plan buffers every linear input and output.
enum class Gemms : std::uint8_t { halide, library };

// An epilogue chain: linear -> dropout / residual sum -> ..., each element computed once from
// the linear's output. Output j continues such a chain when it starts or continues one, nothing
// reads it but the next layer of the chain, and backward does not read it. With Halide GEMMs the
// chain runs in the GEMM's epilogue and j is fused into it (never a buffer of its own); library
// GEMMs fuse nothing, their chain runs elementwise from the GEMM's buffer.
constexpr bool continues_chain(const Block &b, int j) {
  if (!is_internal(b, j) || read_by_backward(b, j) || consumers(b, j) != 1) return false;
  if (!kind(b.layers[j + 1].op).chain_link || b.source(j + 1) != j) return false;
  const Kind &k = kind(b.layers[j].op);
  if (k.gemm) return true;
  return k.chain_link && b.source(j) >= 0 && continues_chain(b, b.source(j));
}
constexpr bool fused(const Block &b, int j, Gemms g = Gemms::halide) {
  return g == Gemms::halide && continues_chain(b, j);
}

constexpr bool feeds_linear(const Block &b, int j) {
  for (int k = j + 1; k < b.n_layers; ++k)
    if (b.source(k) == j && kind(b.layers[k].op).gemm) return true;
  return false;
}

// Output j has a buffer of its own whenever it exists outside registers: GEMM, GELU and
// attention outputs (not fused into a following epilogue) and the end of an epilogue chain (its
// dropout masks are hashed once, not by each reader); with library GEMMs also every linear
// input. Everything else (LayerNorm output, ReLU, dropout and residual sums of buffered values)
// is rebuilt elementwise where it is used.
constexpr bool materialized(const Block &b, int j, Gemms g = Gemms::halide) {
  if (!b.produces(j) || fused(b, j, g)) return false;
  const Kind &k = kind(b.layers[j].op);
  if (k.buffered) return true;
  if (g == Gemms::library && feeds_linear(b, j)) return true;
  return k.chain_link && b.source(j) >= 0 && continues_chain(b, b.source(j)) && !continues_chain(b, j);
}

constexpr bool saved(const Block &b, int j, Keep keep, Gemms g = Gemms::halide) {
  switch (keep) {
  case Keep::all: return read_by_backward(b, j);
  case Keep::selective:
    return read_by_backward(b, j) && materialized(b, j, g) && !kind(b.layers[j].op).recomputed_by_selective;
  case Keep::nothing: return false;
  }
  return false;
}

// bf16 GEMMs read a bf16 copy of the linear's weight, made once per kernel call into its own
// workspace (the master weights stay fp32); library GEMMs a bf16 copy of its bias too (cuBLASLt's
// bias epilogue takes the output's element type).
constexpr bool weight_copy(Precision p) { return p == Precision::bf16; }
constexpr bool bias_copy(Gemms g, Precision p) { return g == Gemms::library && p == Precision::bf16; }
constexpr LocalTensor weight_copy_of(const Block &b, int k) {
  return {cat("p", k, "_w16"), 2, {b.layers[k].out, b.layers[k].in}, k};
}
constexpr LocalTensor bias_copy_of(const Block &b, int k) { return {cat("p", k, "_b16"), 1, {b.layers[k].out, 0}, k}; }
constexpr void add_parameter_copies(std::vector<LocalTensor> &to, const Block &b, int k, Gemms g, Precision p) {
  if (!kind(b.layers[k].op).gemm) return;
  if (weight_copy(p)) to.push_back(weight_copy_of(b, k));
  if (bias_copy(g, p) && b.layers[k].bias) to.push_back(bias_copy_of(b, k));
}

// A kernel's tensors besides x, y, dy, dx and parameters.
struct KernelTensors {
  std::vector<LocalTensor> saved;      // written by forward and kept; read by backward
  std::vector<LocalTensor> scratch;    // internals written and dropped within the kernel call
  std::vector<LocalTensor> workspace;  // the kernel's own short-lived buffers (gradients, weight copies)
};

// Forward: what the policy keeps is written out; outputs that cannot be rebuilt in registers
// (GEMM, GELU, attention, statistics) go to scratch; cheap ones stay in registers.
constexpr KernelTensors forward_tensors(const Block &b, Keep keep, Gemms g = Gemms::halide,
                                        Precision p = Precision::fp32) {
  KernelTensors t;
  for (int j = 0; j < b.n_layers; ++j) {
    if (is_internal(b, j)) {
      if (saved(b, j, keep, g)) t.saved.push_back(output_of(b, j));
      else if (materialized(b, j, g)) t.scratch.push_back(output_of(b, j));
    }
    for (const LocalTensor &st : stats_of(b, j)) (keep == Keep::nothing ? t.scratch : t.saved).push_back(st);
    add_parameter_copies(t.workspace, b, j, g, p);
  }
  return t;
}

// Backward: reads the saved tensors; rebuilds what it reads but was not saved, with the
// outputs those depend on (materialized unless cheap); and its own workspace.
// Library GEMMs: the input gradient of linear k is written by the GEMM into its own buffer dp<k>
// when the linear's input also gets gradient from elsewhere (then the sum is formed after, and
// rounded once: dp<k> stays fp32, like a statistic).
constexpr bool product_buffer(const Block &b, int k, Gemms g) {
  return g == Gemms::library && kind(b.layers[k].op).gemm && consumers(b, b.source(k)) > 1;
}
constexpr LocalTensor product_of(const Block &b, int k) {
  return {cat("dp", k), 2, {b.layers[k].in, -1}, k, false, LocalTensor::Kind::statistic};
}

constexpr KernelTensors backward_tensors(const Block &b, Keep keep, bool needs_input_grad, Gemms g = Gemms::halide,
                                         Precision p = Precision::fp32) {
  KernelTensors t;
  std::array<bool, max_block_layers> needed{};
  for (int j = 0; j < b.n_layers; ++j) needed[j] = read_by_backward(b, j) && !saved(b, j, keep, g);
  for (int j = b.n_layers - 1; j >= 0; --j) {  // inputs of what is rebuilt are needed too
    if (!needed[j]) continue;
    for (int i : {b.source(j), b.layers[j].op == Op::residual_end ? b.skip_source(j) : -1})
      if (i >= 0 && !saved(b, i, keep, g)) needed[i] = true;
  }
  for (int j = 0; j < b.n_layers; ++j) {
    if (is_internal(b, j) && saved(b, j, keep, g)) t.saved.push_back(output_of(b, j));
    // A rebuilt value that a linear's weight gradient reads is buffered even when cheap: the
    // gradient GEMM reads each element once per output tile.
    if (is_internal(b, j) && needed[j] && (materialized(b, j, g) || feeds_linear(b, j)))
      t.scratch.push_back(output_of(b, j));
    for (const LocalTensor &st : stats_of(b, j)) (keep == Keep::nothing ? t.scratch : t.saved).push_back(st);
  }
  for (int j = 0; j < b.n_layers; ++j) {  // workspace
    const Layer &l = b.layers[j];
    const bool grad_in = b.source(j) >= 0 || needs_input_grad;
    if (is_internal(b, j)) t.workspace.push_back(rows(cat("dh", j), l.out, j));
    add_tensors(t.workspace, kind(l.op).workspace, b, j, LocalTensor::Kind::statistic, grad_in);
    add_parameter_copies(t.workspace, b, j, g, p);
    if (kind(l.op).gemm && grad_in && g == Gemms::halide) t.workspace.push_back({cat("p", j, "_wt"), 2, {l.in, l.out}, j});
    if (product_buffer(b, j, g) && grad_in) t.workspace.push_back(product_of(b, j));
  }
  return t;
}

constexpr std::vector<LocalTensor> params(const Block &b) {
  std::vector<LocalTensor> out;
  for (int k = 0; k < b.n_layers; ++k) add_tensors(out, kind(b.layers[k].op).params, b, k, LocalTensor::Kind::parameter);
  return out;
}

constexpr Name grad_name(const Name &param) {  // p3_w -> g3_w
  Name g = param;
  g.chars[0] = 'g';
  return g;
}

// ---------------------------------------------------------------------------------------------
// Kernels and the plan
// ---------------------------------------------------------------------------------------------
enum class Variant : std::uint8_t {
  forward_save,        // writes the block output and every internal backward reads
  forward_selective,   // ... except what the selective policy recomputes
  forward_discard,     // writes the block output; internals only as short-lived scratch
  backward_saved,      // backward from saved internals
  backward_selective,  // backward recomputing the attention core and GELU inside the kernel
  backward_recompute,  // backward with the whole forward recompute fused in; takes the block input
  loss,                // softmax cross-entropy: per-row loss, correctness and logits gradient
  adamw,               // optimizer update over a flat range of parameters
};

// The arithmetic of one call of a block's kernel over `rows` rows: its kinds' flops (GEMMs and
// attention products), backward's multiple of them, and the forward work a variant recomputes.
constexpr double kernel_flops(const Block &b, Variant v, long long rows) {
  double forward = 0, backward = 0, rebuilt_by_selective = 0;
  for (int j = 0; j < b.n_layers; ++j) {
    const Kind &k = kind(b.layers[j].op);
    if (!k.flops) continue;
    const double f = double(rows) * k.flops(b.layers[j]);
    forward += f;
    backward += k.backward_flops * f;
    if (k.recomputed_by_selective) rebuilt_by_selective += f;
  }
  switch (v) {
  case Variant::forward_save:
  case Variant::forward_selective:
  case Variant::forward_discard: return forward;
  case Variant::backward_saved: return backward;
  case Variant::backward_selective: return backward + rebuilt_by_selective;
  case Variant::backward_recompute: return backward + forward;
  case Variant::loss:
  case Variant::adamw: return 0;
  }
  return 0;
}

constexpr std::string_view variant_name(Variant v) {
  switch (v) {
  case Variant::forward_save: return "forward_save";
  case Variant::forward_selective: return "forward_selective";
  case Variant::forward_discard: return "forward_discard";
  case Variant::backward_saved: return "backward_saved";
  case Variant::backward_selective: return "backward_selective";
  case Variant::backward_recompute: return "backward_recompute";
  case Variant::loss: return "loss";
  case Variant::adamw: return "adamw";
  }
  return "?";
}

constexpr Variant forward_variant(Keep k) {
  return k == Keep::all ? Variant::forward_save : k == Keep::selective ? Variant::forward_selective : Variant::forward_discard;
}
constexpr Variant backward_variant(Keep k) {
  return k == Keep::all ? Variant::backward_saved : k == Keep::selective ? Variant::backward_selective : Variant::backward_recompute;
}

// Kernel symbol: <model>_s<stage>_<variant>, <model>_loss, <model>_adamw, with a _bf16 suffix
// for bf16 kernels (AdamW works on fp32 only and is shared).
constexpr Name kernel_name(std::string_view model, int stage, Variant v, Precision p = Precision::fp32) {
  const std::string_view suffix = p == Precision::bf16 && v != Variant::adamw ? "_bf16" : "";
  if (v == Variant::loss || v == Variant::adamw) return cat(model, "_", variant_name(v), suffix);
  return cat(model, "_s", stage, "_", variant_name(v), suffix);
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
  int stage = -1, block = -1, layer = -1;  // where it comes from, for reports
  Init init = Init::zeros;                  // parameters: how the trainer starts them
  constexpr std::size_t bytes() const {
    long long n = elem_bytes;
    for (int d = 0; d < dims; ++d) n *= extent[d];
    return std::size_t(n);
  }
};

// Whether a kernel reads an argument or writes it (a Halide input or output buffer). An argument
// read and written in place (gradients accumulated, AdamW's state) is bound twice, once each way.
enum class Access : std::uint8_t { read, write };

struct Arg {
  Name name;   // the kernel argument's name
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
  Precision precision;
  Gemms gemms;
  long long n_rows = 0;
  Plan plan{};

  constexpr int add(Tensor t) {
    plan.tensors.push_back(t);
    return int(plan.tensors.size()) - 1;
  }
  bool naming_eval = false;  // evaluation tensors are named eval.<name>
  constexpr int local(int stage, int block, Role role, const LocalTensor &lt) {
    Tensor t{cat(naming_eval ? "eval." : "", prefix(stage, block).view(), lt.name.view()), role, lt.dims};
    t.elem_bytes = element_bytes(lt, precision);
    for (int d = 0; d < lt.dims; ++d) t.extent[d] = lt.extent[d] < 0 ? n_rows : lt.extent[d];
    t.stage = stage;
    t.block = block;
    t.layer = lt.layer;
    t.init = lt.init;
    return add(t);
  }
  constexpr void free_activation(Step &st, int t) const {  // data tensors stay
    if (plan.tensors[t].role != Role::data) st.free.push_back(t);
  }
  static constexpr Name prefix(int stage, int block) { return cat("s", stage, ".b", block, "."); }

  // Per (stage, block): tensor ids of parameters, gradients (views into the flat buffers).
  std::vector<std::vector<std::vector<Arg>>> param_args{}, grad_args{};
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
      param_args[s].resize(m.stages[s].repeat);
      grad_args[s].resize(m.stages[s].repeat);
    }
    // Two passes: decayed parameters (linear weights) first, so AdamW runs on two flat ranges.
    // Each parameter starts on an arena_alignment boundary (GEMM libraries want aligned operands,
    // and an alignment that is the same under every policy); the padding floats stay zero.
    long long count = 0, slots = 0;
    for (bool decayed : {true, false}) {
      for (int s = 0; s < m.n_stages; ++s)
        for (int b = 0; b < m.stages[s].repeat; ++b)
          for (const LocalTensor &lt : params(m.stages[s])) {
            if (lt.decay != decayed) continue;
            const int p = local(s, b, Role::params, lt);
            slots = (slots + slot_alignment - 1) / slot_alignment * slot_alignment;
            plan.tensors[p].view_of = params_root;
            plan.tensors[p].offset = std::size_t(slots) * 4;
            Tensor g = plan.tensors[p];
            g.name = cat(prefix(s, b).view(), grad_name(lt.name).view());
            g.role = Role::grads;
            g.view_of = grads_root;
            param_args[s][b].push_back({lt.name, p});
            grad_args[s][b].push_back({grad_name(lt.name), add(g)});
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
  constexpr void bind_params(Step &st, bool grads) const {
    for (const Arg &a : param_args[st.stage][st.block]) st.args.push_back(a);
    if (grads)
      for (const Arg &a : grad_args[st.stage][st.block]) {
        st.args.push_back({a.name, a.tensor, Access::write});
        st.args.push_back({cat(a.name.view(), "_prev"), a.tensor});  // accumulated in place
      }
  }

  struct Unit { int stage, block, index, rng; };

  // Forward of one block. Returns the output tensor; the kept internals go to *kept with `role`.
  constexpr int forward(std::vector<Step> &out, const Unit &u, int x, Keep keep, Role role,
                        std::vector<int> *kept) {
    const Block &blk = m.stages[u.stage];
    Step st = step(u.stage, forward_variant(keep), u.block, u.rng);
    const int y = local(u.stage, u.block, Role::block_input, rows("y", blk.out()));
    st.alloc.push_back(y);
    st.args.push_back({"x", x});
    st.args.push_back({"y", y, Access::write});
    bind_params(st, false);
    const KernelTensors kt = forward_tensors(blk, keep, gemms, precision);
    for (const LocalTensor &lt : kt.saved) {
      const int t = local(u.stage, u.block, role, lt);
      st.alloc.push_back(t);
      st.args.push_back({lt.name, t, Access::write});
      if (kept) kept->push_back(t);
    }
    for (const auto &[list, role] : {std::pair{&kt.scratch, Role::recomputed}, {&kt.workspace, Role::scratch}})
      for (const LocalTensor &lt : *list) {
        const int t = local(u.stage, u.block, role, lt);
        st.alloc.push_back(t);
        st.args.push_back({lt.name, t, Access::write});
        st.free.push_back(t);
      }
    out.push_back(st);
    return y;
  }

  // Backward of one block: consumes dy, produces dx (unless it is the model's first stage).
  constexpr int backward(std::vector<Step> &out, const Unit &u, int x, int dy,
                         const std::vector<int> &kept, Keep keep) {
    const Block &blk = m.stages[u.stage];
    const bool needs_dx = needs_input_grad(m, u.stage);
    Step st = step(u.stage, backward_variant(keep), u.block, u.rng);
    st.recompute = keep != Keep::all;
    int dx = -1;
    if (needs_dx) {
      dx = local(u.stage, u.block, Role::gradient, rows("dx", blk.in()));
      st.alloc.push_back(dx);
      st.args.push_back({"dx", dx, Access::write});
    }
    st.args.push_back({"x", x});
    st.args.push_back({"dy", dy});
    bind_params(st, true);
    const KernelTensors kt = backward_tensors(blk, keep, needs_dx, gemms, precision);
    for (int t : kept) {
      const auto local_name = plan.tensors[t].name.view().substr(prefix(u.stage, u.block).size() + (naming_eval ? 5 : 0));
      st.args.push_back({Name{}.append(local_name), t});
      st.free.push_back(t);
    }
    for (const auto &[list, role] : {std::pair{&kt.scratch, Role::recomputed}, {&kt.workspace, Role::scratch}})
      for (const LocalTensor &lt : *list) {
        const int t = local(u.stage, u.block, role, lt);
        st.alloc.push_back(t);
        st.args.push_back({lt.name, t, Access::write});
        st.free.push_back(t);
      }
    st.free.push_back(dy);
    out.push_back(st);
    return dx;
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
    Step loss = step(-1, Variant::loss, 0, 0);
    const int logit_bytes = element_bytes(rows("dlogits", m.classes()), precision);
    const int dlogits = add({"dlogits", Role::gradient, 2, {m.classes(), n_rows}, logit_bytes});
    loss.alloc.push_back(dlogits);
    loss.args = {{"logits", x}, {"labels", labels}, {"dlogits", dlogits, Access::write}};
    for (int i = 0; i < 4; ++i) loss.args.push_back({metric_names[i], metrics[i], Access::write});
    loss.free.push_back(x);
    plan.train.push_back(loss);
    // ---- backward ----
    int dy = dlogits;
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
        st.args.push_back({out, st.args[in].tensor, Access::write});
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
    Step eval_loss = loss;
    const int eval_dlogits = add({"eval_dlogits", Role::gradient, 2, {m.classes(), n_rows}, logit_bytes});
    eval_loss.alloc = {eval_dlogits};
    eval_loss.args[0].tensor = x;
    eval_loss.args[2].tensor = eval_dlogits;
    eval_loss.free = {x, eval_dlogits};
    plan.eval.push_back(eval_loss);

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

}  // namespace detail

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
