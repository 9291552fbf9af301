// module remat.language: what a model is written in. Layers and their kinds (each kind's traits and
// constructor are a partition of this module, in its folder generators/kinds/<kind>/; the table of
// all of them is built here from generators/kinds/list.h), blocks, stacks and models, shape
// inference and checking, checkpoint policies. Model modules import this and nothing else, so that
// the kernels generated for them depend on it alone.
//
// Letter legend used in shape comments: B batch rows, C features of a tensor, K inner width of a
// Linear, O output width of a Linear.
module;
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string_view>
#include <vector>
export module remat.language;
export import :core;
export import :kinds;  // every kind's partition (generated from generators/kinds/list.h)

export namespace remat {

// ---------------------------------------------------------------------------------------------
// The kinds' traits, by Op
// ---------------------------------------------------------------------------------------------
namespace kinds {
inline constexpr std::array<Kind, n_ops> table = {{
#define REMAT_KIND(name) name,
#include "kinds/list.h"
#undef REMAT_KIND
}};
}  // namespace kinds

constexpr const Kind &kind(Op op) { return kinds::table[std::size_t(op)]; }
constexpr std::string_view op_name(Op op) { return kind(op).name; }

// ---------------------------------------------------------------------------------------------
// Checkpoint policies: composable values (a | b). A policy has at most one recompute schedule (none,
// full, every_n_layers, sqrt_n, or a memory budget the planner solves for), may make the blocks
// that keep their internals keep only a selective set (selective, save_only_these_names,
// recompute_modules), and may offload checkpoints. A model carries a default policy; a repeat
// stage may carry its own (repeat(n, block, policy)); the trainer's flags override either.
// ---------------------------------------------------------------------------------------------
inline constexpr int max_policy_names = 6;

// Which internals a selective block keeps (every other internal its backward reads is rebuilt
// inside its backward kernel). standard: Megatron's choice (the attention core and the MLP's
// activation are recomputed); names: only the outputs of the layers named here (remat::name);
// modules: all but the outputs of the listed modules.
struct Selection {
  enum class Rule : std::uint8_t { standard, names, modules } rule = Rule::standard;
  std::array<Tag, max_policy_names> names{};
  int n_names = 0;
  std::uint8_t modules = 0;  // bit 1 << Module
  // names: bit i set: names[i] is kept in pinned host memory between the forward that makes it and
  // the backward that reads it (copied out after the forward, brought back one step ahead).
  std::uint8_t offloaded = 0;
  constexpr int index_of(const Tag &t) const {
    for (int i = 0; i < n_names; ++i)
      if (t.size() > 0 && names[i] == t) return i;
    return -1;
  }
  constexpr bool names_tag(const Tag &t) const { return index_of(t) >= 0; }
  constexpr bool offloads_tag(const Tag &t) const {
    const int i = index_of(t);
    return i >= 0 && ((offloaded >> i) & 1u);
  }
  constexpr bool operator==(const Selection &) const = default;
};

struct Policy {
  enum class Kind : std::uint8_t { none, full, every_n_layers, sqrt_n, budget } kind = Kind::none;
  int n = 0;               // every_n_layers
  bool selective = false;  // blocks that keep their internals keep only `selection`
  // The checkpoints (inputs kept by segments that recompute) wait in pinned host memory between
  // their forward and backward: copied out after the block's forward, brought back one block
  // ahead of the backward that reads them.
  bool offload = false;
  Selection selection{};
  // budget: the plan's peak in bytes, or (budget_percent > 0) a percentage of the none plan's peak
  long long budget_bytes = 0;
  int budget_percent = 0;
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
inline constexpr Policy selective{.selective = true};
inline constexpr Policy offload{.offload = true};

// Blocks 0, n, 2n... are checkpointed, the others keep their internals (as in HF Transformers).
consteval Policy every_n_layers(int n) {
  if (n < 1) throw "remat: every_n_layers(n) needs n >= 1";
  return {Policy::Kind::every_n_layers, n};
}

// The fastest plan whose peak (arena placement included) is at most `bytes`, chosen by the
// planner's dynamic program over the chain of blocks.
inline constexpr long long KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;
constexpr Policy budget(long long bytes) {
  if (bytes < 1) throw "remat: budget(bytes) needs bytes >= 1";
  return {.kind = Policy::Kind::budget, .budget_bytes = bytes};
}
// ... at most `percent` % of the none plan's peak.
constexpr Policy budget_percent(int percent) {
  if (percent < 1 || percent > 100) throw "remat: budget_percent(p) needs 1 <= p <= 100";
  return {.kind = Policy::Kind::budget, .budget_percent = percent};
}

// Selective blocks keep only the outputs of the layers named so (JAX's save_only_these_names).
template <class... Names>
constexpr Policy save_only_these_names(Names... names) {
  static_assert(sizeof...(names) <= max_policy_names, "remat: save_only_these_names takes at most 6 names");
  Policy p{.selective = true};
  p.selection.rule = Selection::Rule::names;
  ((p.selection.names[p.selection.n_names++] = Tag(names)), ...);
  return p;
}
// Selective blocks keep the outputs of the layers named in `saved` in device memory and those named
// in `offloaded` in pinned host memory until their backward; every other internal is rebuilt (JAX's
// save_and_offload_only_these_names). Offloading is for CUDA; the CPU runs the same plan with copies.
constexpr Policy save_and_offload_only_these_names(std::initializer_list<const char *> saved,
                                                   std::initializer_list<const char *> offloaded) {
  if (saved.size() + offloaded.size() > std::size_t(max_policy_names))
    throw "remat: save_and_offload_only_these_names takes at most 6 names";
  if (offloaded.size() == 0) throw "remat: save_and_offload_only_these_names needs a name to offload";
  Policy p{.selective = true};
  p.selection.rule = Selection::Rule::names;
  for (const char *n : saved) p.selection.names[p.selection.n_names++] = Tag(n);
  for (const char *n : offloaded) {
    p.selection.offloaded |= std::uint8_t(1u << p.selection.n_names);
    p.selection.names[p.selection.n_names++] = Tag(n);
  }
  return p;
}
// Selective blocks rebuild the outputs of these modules and keep the rest (Megatron's
// recompute_modules: core_attn, layernorm -> norm, mlp's activation -> activation).
template <class... Modules>
constexpr Policy recompute_modules(Modules... modules) {
  Policy p{.selective = true};
  p.selection.rule = Selection::Rule::modules;
  ((p.selection.modules |= std::uint8_t(1u << unsigned(Module(modules)))), ...);
  return p;
}
inline constexpr Module core_attn = Module::core_attn, activation = Module::activation, norm = Module::norm,
                        projection = Module::projection, rotary = Module::rope;
// The selective set of `set` only, its blocks not run selectively: a stage annotated
// `full | selective_set(recompute_modules(...))` is checkpointed by default and its selective
// kernels (what --checkpoint-policy selective runs) keep that set.
constexpr Policy selective_set(Policy set) {
  set.selective = false;
  return set;
}

// Why a | b does not compose (empty: it does): two different recompute schedules, or two
// different selective sets.
constexpr std::string_view composition_error(const Policy &a, const Policy &b) {
  if (a.kind != Policy::Kind::none && b.kind != Policy::Kind::none &&
      (a.kind != b.kind || a.n != b.n || a.budget_bytes != b.budget_bytes || a.budget_percent != b.budget_percent))
    return "a policy has at most one recompute schedule (none, full, every_n_layers, sqrt_n, budget)";
  if (a.selection.rule != Selection::Rule::standard && b.selection.rule != Selection::Rule::standard &&
      !(a.selection == b.selection))
    return "a policy names at most one selective set";
  return {};
}

// a | b: the recompute schedule of whichever has one (two different ones do not compose), the
// selective set of whichever names one, offload if either does.
constexpr Policy operator|(Policy a, const Policy &b) {
  if (!composition_error(a, b).empty()) throw "remat: policies that do not compose (composition_error says why)";
  if (b.kind != Policy::Kind::none) {
    a.kind = b.kind;
    a.n = b.n;
    a.budget_bytes = b.budget_bytes;
    a.budget_percent = b.budget_percent;
  }
  if (b.selection.rule != Selection::Rule::standard) a.selection = b.selection;
  a.selective = a.selective || b.selective;
  a.offload = a.offload || b.offload;
  return a;
}

constexpr Message policy_name(const Policy &p) {
  Message out;
  switch (p.kind) {
  case Policy::Kind::none: out.append(p.selective ? "" : "none"); break;
  case Policy::Kind::full: out.append("full"); break;
  case Policy::Kind::every_n_layers: out.append("every_n_layers=").append(p.n); break;
  case Policy::Kind::sqrt_n: out.append("sqrt_n"); break;
  case Policy::Kind::budget:
    out.append("budget=");
    if (p.budget_percent > 0)
      out.append(p.budget_percent).append("%");
    else
      out.append(p.budget_bytes).append("B");
    break;
  }
  if (p.selective) {
    out.append(out.size() > 0 ? "+selective" : "selective");
    const Selection &s = p.selection;
    if (s.rule == Selection::Rule::names) {
      out.append("(save:");
      for (int i = 0, first = 1; i < s.n_names; ++i)
        if (!((s.offloaded >> i) & 1u)) {
          out.append(first ? "" : ",").append(s.names[i]);
          first = 0;
        }
      if (s.offloaded) {
        out.append(";offload:");
        for (int i = 0, first = 1; i < s.n_names; ++i)
          if ((s.offloaded >> i) & 1u) {
            out.append(first ? "" : ",").append(s.names[i]);
            first = 0;
          }
      }
      out.append(")");
    } else if (s.rule == Selection::Rule::modules) {
      constexpr std::string_view names[] = {"none", "core_attn", "activation", "norm", "projection", "rope"};
      out.append("(recompute:");
      for (int m = 0, first = 1; m < 6; ++m)
        if (s.modules & (1u << m)) {
          out.append(first ? "" : ",").append(names[m]);
          first = 0;
        }
      out.append(")");
    }
  }
  if (p.offload) out.append("+offload");
  return out;
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
  bool annotated = false;       // repeat(n, block, policy): the stage's own policy
  Policy policy{};              // ... which also fixes what its selective kernels keep
  int overflow = 0;             // layers past max_block_layers, reported by check()

  constexpr int in() const { return layers[0].in; }
  constexpr int out() const { return layers[n_layers - 1].out; }
  constexpr void push(const Layer &l) {
    if (n_layers == max_block_layers)
      ++overflow;
    else
      layers[n_layers++] = l;
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
template <class... L>
constexpr Block residual(L... layers) {
  Block b;
  b.push({Op::residual_begin});
  (b.push(layers), ...);
  b.push({Op::residual_end});
  return b;
}
// Blocks and layers one after the other, as one block (e.g. a transformer block: two residual
// branches; or plain layers, a block without a residual).
template <class... B>
constexpr Block chain(B... blocks) {
  Block out;
  ((out = chain_one(out, blocks)), ...);
  return out;
}
constexpr Block repeat(int n, Block b) {
  b.repeat = n;
  b.checkpointable = true;
  return b;
}
// A repeat stage with its own policy (e.g. repeat(6, block, selective)); what it says about
// selective sets shapes the stage's kernels, so only the rest can change at run time.
constexpr Block repeat(int n, Block b, Policy policy) {
  b = repeat(n, b);
  b.annotated = true;
  b.policy = policy;
  return b;
}

// Names layer l's output tensor, for save_only_these_names.
constexpr Layer name(Tag tag, Layer l) {
  l.tag = tag;
  return l;
}

// Outputs of layers before the last (the last one's output is y).
constexpr bool is_internal(const Block &b, int k) { return k + 1 < b.n_layers && b.produces(k); }

// Backward reads output j: a later layer's rule reads its input j, or j's own rule reads its
// output (attention).
constexpr int reader_of(const Block &b, int j);
constexpr bool read_by_backward(const Block &b, int j) { return is_internal(b, j) && reader_of(b, j) >= 0; }

// The layer whose backward reads output j (j's own, when its kind reads its output; -1: none).
constexpr int reader_of(const Block &b, int j) {
  if (kind(b.layers[j].op).reads_output) return j;
  for (int k = j + 1; k < b.n_layers; ++k)
    if (b.source(k) == j && kind(b.layers[k].op).reads_input) return k;
  return -1;
}

// Whether a selective block rebuilds output j in its backward instead of keeping it: the
// stage's selective set (its annotation's), by default Megatron's.
constexpr bool selective_recomputes(const Block &b, int j) {
  const Selection &s = b.policy.selection;
  const Layer &l = b.layers[j];
  switch (s.rule) {
  case Selection::Rule::standard: return kind(l.op).recomputed_by_selective;
  case Selection::Rule::names: return !s.names_tag(l.tag);
  case Selection::Rule::modules: return (s.modules >> unsigned(kind(l.op).module)) & 1u;
  }
  return false;
}

// Model inputs: feature rows, or token ids with `block_size` rows per sequence.
struct Input {
  int width = 0;
  int vocab = 0;
  int block_size = 0;
};
constexpr Input input(int width) { return {width}; }
constexpr Input tokens(int vocab, int block_size) { return {1, vocab == 0 ? -1 : vocab, block_size}; }

struct Loss {
  int classes = 0;
};
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

}  // namespace remat

// Not exported: how make_model folds its parts.
namespace remat::detail {
constexpr void add(Model &m, Input in) { m.input = in; }
constexpr void add(Model &m, Loss l) { m.loss = l; }
constexpr void add(Model &m, Block b) {
  if (m.n_stages == max_stages) {
    ++m.stage_overflow;
    return;
  }
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
}  // namespace remat::detail

export namespace remat {

template <class... Parts>
constexpr Model make_model(Parts... parts) {
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

// "stage s layer k (kind)", k counting the layers as written (residual markers left out).
constexpr Message layer_position(const Model &m, int s, int k) {
  int written = 0;
  for (int j = 0; j < k; ++j)
    written += m.stages[s].layers[j].op != Op::residual_begin && m.stages[s].layers[j].op != Op::residual_end;
  return cat<Message>("stage ", s, " layer ", written, " (", op_name(m.stages[s].layers[k].op), ")");
}

// Resolves each tied linear's target (remat::tied_to) to its stage and layer, or says why the tie
// cannot be: no layer of that name, a target that is not an embedding, shapes that do not fit, a
// bias, a repeated layer, or a target that is not in an earlier stage (its backward must run
// after the tied layer's, which writes the shared gradient first).
constexpr Message resolve_ties(Model &m) {
  for (int s = 0; s < m.n_stages; ++s)
    for (int k = 0; k < m.stages[s].n_layers; ++k) {
      Layer &l = m.stages[s].layers[k];
      if (!l.tied()) continue;
      const Message where = cat<Message>(layer_position(m, s, k), ": tied_to(\"", l.tie, "\")");
      int ts = -1, tk = -1;
      for (int t = 0; t < m.n_stages && ts < 0; ++t)
        for (int j = 0; j < m.stages[t].n_layers; ++j)
          if (m.stages[t].layers[j].tag == l.tie) {
            ts = t;
            tk = j;
            break;
          }
      if (ts < 0) return cat<Message>(where, ": no layer is named so");
      const Layer &target = m.stages[ts].layers[tk];
      const Message there = layer_position(m, ts, tk);
      if (target.op != Op::embedding) return cat<Message>(where, ": ", there, " is not an embedding");
      if (target.vocab != l.out || target.out != l.in)
        return cat<Message>(where, ": its weight [", l.in, ", ", l.out, "] is not the transpose of the token table [",
                            target.vocab, ", ", target.out, "] of ", there);
      if (l.bias) return cat<Message>(where, ": a tied linear has no bias (linear(in, out, no_bias, tied_to(...)))");
      if (m.stages[s].repeat > 1) return cat<Message>(where, ": a repeated layer cannot share a weight");
      if (ts >= s) return cat<Message>(where, ": ", there, " must be in an earlier stage");
      l.tie_stage = ts;
      l.tie_layer = tk;
    }
  return {};
}

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
      if (!kd.repeatable && b.repeat > 1) return fail(cat<Message>(where, ": cannot be repeated"));
      if (kd.reads_output && k + 1 == b.n_layers)
        return fail(cat<Message>(where, ": cannot end a block (its backward reads its output)"));
      width = l.out;
    }
    for (int k = 0; k < b.n_layers; ++k)
      for (int j = k + 1; j < b.n_layers; ++j)
        if (b.layers[k].tag.size() > 0 && b.layers[k].tag == b.layers[j].tag)
          return fail(cat<Message>("stage ", s, ": two layers are named \"", b.layers[k].tag, "\""));
    if (b.annotated) {
      const Policy &p = b.policy;
      if (p.kind == Policy::Kind::budget)
        return fail(cat<Message>("stage ", s, ": a memory budget is the whole model's policy, not a stage's"));
      const std::string_view rule =
          p.selection.offloaded ? "save_and_offload_only_these_names" : "save_only_these_names";
      for (int i = 0; i < p.selection.n_names; ++i) {
        const Tag &t = p.selection.names[i];
        const std::string_view what = (p.selection.offloaded >> i) & 1u ? "offload" : "save";
        int k = 0;
        while (k < b.n_layers && !(b.layers[k].tag == t)) ++k;
        if (k == b.n_layers)
          return fail(cat<Message>("stage ", s, ": ", rule, "(\"", t, "\"): no layer of the block is named so"));
        if (!read_by_backward(b, k))
          return fail(cat<Message>("stage ", s, ": ", rule, "(\"", t, "\"): the output of layer ", k, " (",
                                   op_name(b.layers[k].op), ") is not read by backward; there is nothing to ", what));
      }
    }
    if (b.repeat > 1 && width != block_in)
      return fail(cat<Message>("stage ", s, ": repeat(", b.repeat,
                               ", ...) needs a block that keeps its width, but it maps ", block_in, " features to ",
                               width));
  }
  if (const Message wrong = resolve_ties(m); wrong.size() > 0) return fail(wrong);
  if (m.loss.classes == 0) m.loss.classes = width;
  if (m.loss.classes != width)
    return fail(cat<Message>("softmax_cross_entropy(", m.loss.classes, ") follows a stack of width ", width));
  return {m, {}};
}

// ---------------------------------------------------------------------------------------------
// How a model's trainer starts: its model module's `inline constexpr remat::TrainerDefaults trainer`,
// which the generated main (remat_add_trainer, whose DATA says what the trainer reads) hands to the
// shared trainer; flags override it.
// ---------------------------------------------------------------------------------------------
struct TrainerDefaults {
  std::string_view data_dir;  // the dataset's folder (--data-dir)
  int batch = 128;            // --batch-size
  int epochs = 3;             // --num-train-epochs
  long max_steps = 0;         // --max-steps (0: epochs worth)
  double learning_rate = 1e-3;
  int warmup_steps = 0;
  int eval_samples = -1;  // -1: the whole evaluation split
  int eval_steps = 0;     // 0: evaluate only at the end
  int sample_length = 0;  // token models: characters to generate at the end
  // The Transformers architecture its weights are ("gpt2": GPT2LMHeadModel, "llama":
  // LlamaForCausalLM; empty: none): --init-from takes a Transformers folder, --save-hf writes one.
  std::string_view transformers;
};

// A model that failed check() does not compile; the message names the layer and the widths:
//   inline constexpr remat::Model model = remat::checked([] { return remat::make_model(...); });
// The model comes as a lambda that makes it, not as a template argument, so that the compiler's
// "in instantiation of" note names the lambda's line instead of printing the model's value.
template <class MakeModel>
consteval Model checked(MakeModel) {
  constexpr Checked c = check(MakeModel{}());
  static_assert(c.ok(), c.error);
  return c.model;
}

}  // namespace remat
