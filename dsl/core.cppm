// Partition remat.language:core: what every layer kind is described with. Short constexpr names,
// the Op of each kind (generated from generators/kinds/list.h), a layer, and a kind's traits
// (Kind: its shape rule, what its backward reads, its tensors); each kind's folder fills one in.
module;
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
export module remat.language:core;

export namespace remat {

// ---------------------------------------------------------------------------------------------
// Names: short fixed strings usable in constant expressions (kernel argument names, messages).
// ---------------------------------------------------------------------------------------------
template <std::size_t Capacity>
struct Text {
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
    if (v < 0) {
      append("-");
      v = -v;
    }
    char digits[24]{};
    int n = 0;
    do {
      digits[n++] = char('0' + v % 10);
      v /= 10;
    } while (v > 0);
    while (n > 0) append(std::string_view(&digits[--n], 1));
    return *this;
  }
  constexpr Text &append(int v) { return append((long long)v); }
  template <std::size_t M>
  constexpr Text &append(const Text<M> &t) {
    return append(t.view());
  }
  constexpr std::string_view view() const { return {chars.data(), std::size_t(length)}; }
  constexpr const char *data() const { return chars.data(); }
  constexpr int size() const { return length; }
  constexpr bool operator==(const Text &o) const { return view() == o.view(); }
  constexpr bool operator==(std::string_view o) const { return view() == o; }
};

using Name = Text<40>;      // tensor and kernel names
using Message = Text<200>;  // diagnostics
using Tag = Text<24>;       // a layer's name for its output tensor (remat::name)

template <class Out = Name, class... Parts>
constexpr Out cat(Parts... parts) {
  Out n;
  (n.append(parts), ...);
  return n;
}

// ---------------------------------------------------------------------------------------------
// Layers and their kinds
// ---------------------------------------------------------------------------------------------
// The layer kinds, in the order of generators/kinds/list.h (one line there per kind).
enum class Op : std::uint8_t {
#define REMAT_KIND(name) name,
#include "kinds/list.h"
#undef REMAT_KIND
};
inline constexpr int n_ops = 0
#define REMAT_KIND(name) +1
#include "kinds/list.h"
#undef REMAT_KIND
    ;

// A layer maps C_in features to C_out features per row. 0 means "inferred from the stack".
struct Layer {
  Op op{};
  int in = 0;
  int out = 0;
  int heads = 0;          // attention, rope: query heads
  int kv_heads = 0;       // attention, rope: key / value heads (a divisor of heads; fewer: grouped-query)
  int vocab = 0;          // embedding
  int block_size = 0;     // attention, embedding: T, the rows of one sequence (from the input)
  bool bias = true;       // linear: y = x w + b (false: y = x w); embedding: a position table
  Tag tag{};              // the name of its output tensor, for policies (remat::name); empty: none
  double eps = 0;         // layer_norm, rms_norm: the epsilon added to the variance (set by their constructors)
  double rope_theta = 0;  // rope: the base of the rotation frequencies (set by its constructor)
  struct RopeScaling {    // rope: rope_type "llama3" (remat::rope_llama3); factor 0: none
    double factor = 0, low_freq_factor = 0, high_freq_factor = 0;
    int original_context = 0;
    constexpr bool enabled() const { return factor > 0; }
  } rope_scaling{};
  bool gelu_exact = false;  // gelu: 0.5 x (1 + erf(x / sqrt 2)) (Transformers' "gelu"); false: the tanh form
  // linear: its weight is the token table of the embedding named so (remat::tied_to), read
  // transposed; check() resolves the name to that layer's stage and index.
  Tag tie{};
  int tie_stage = -1, tie_layer = -1;
  constexpr bool tied() const { return tie.size() > 0; }
};

// Compile-time constants of the kinds that carry them, as real configs vary them:
// remat::rms_norm(remat::epsilon(1e-5)), remat::rope(9, 3, remat::rope_theta(100000)),
// remat::rope(32, 8, remat::rope_theta(500000), remat::rope_llama3(32, 1, 4, 8192)).
struct Epsilon {
  double value;
};
constexpr Epsilon epsilon(double value) { return {value}; }
struct RopeTheta {
  double value;
};
constexpr RopeTheta rope_theta(double value) { return {value}; }
// A config's rope_parameters of rope_type "llama3" (Llama 3.1, 3.2): the inverse frequencies whose
// wavelength exceeds original_max_position_embeddings / low_freq_factor divided by factor, those
// below original / high_freq_factor kept, those between blended (Transformers' llama3 rule).
constexpr Layer::RopeScaling rope_llama3(double factor, double low_freq_factor, double high_freq_factor,
                                         int original_max_position_embeddings) {
  if (!(factor >= 1) || !(low_freq_factor > 0) || !(high_freq_factor > low_freq_factor) ||
      original_max_position_embeddings < 1)
    throw "remat: rope_llama3(factor, low, high, original) needs factor >= 1, 0 < low < high and original >= 1";
  return {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings};
}

// What a layer is, for policies that name modules (Megatron's recompute_modules): core_attn the
// attention core, activation GELU / ReLU / SwiGLU, norm LayerNorm / RMSNorm, projection the
// linears, rope the rotary embedding. The other kinds belong to none.
enum class Module : std::uint8_t { none, core_attn, activation, norm, projection, rope };

// The dimensions of a layer's tensors, in terms of the layer.
// per_head_qkv: an attention's gradient of q, k and v for each query head, 3 x heads x head dim
enum class Dim : std::uint8_t { none, rows, in, out, vocab, block_size, heads, per_head_qkv };
constexpr long long dim_of(const Layer &l, Dim d) {
  switch (d) {
  case Dim::none: return 0;
  case Dim::rows: return -1;
  case Dim::in: return l.in;
  case Dim::out: return l.out;
  case Dim::vocab: return l.vocab;
  case Dim::block_size: return l.block_size;
  case Dim::heads: return l.heads;
  case Dim::per_head_qkv: return 3LL * l.out;
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
  std::array<Dim, 2> extent{};  // extent[0] is the innermost (contiguous) dimension
  Init init = Init::zeros;      // parameters
  bool decay = false;           // parameters: AdamW weight decay applies
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
// tests know about a kind of layer, in one entry: its folder's traits.cppm (generators/kinds/<kind>/,
// which also holds the kind's algorithm, its model-compiler rules and its float64 reference).
struct Kind {
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
  bool gemm = false;                     // y = x w (+ b): GEMM weight copies, starts an epilogue chain
  // Its CPU kernels are library calls that read their input from a buffer (as GEMMs do): the
  // planner materializes the input.
  bool reads_input_buffer = false;
  bool chain_link = false;   // elementwise on its source, continues an epilogue chain (dropout, residual sum)
  bool draws_masks = false;  // reads the dropout counters (seed, step, block)
  // Element (c, b) of its output depends on element (c, b) of its input alone, and so does its
  // input's gradient on its output's: backward may write the one over the other (in place).
  bool elementwise = false;
  bool repeatable = true;
  Module module = Module::none;
  TensorRules params{};     // parameters, their gradients g<k>_<suffix>
  TensorRules stats{};      // row statistics forward writes and backward reads
  TensorRules workspace{};  // backward's own short-lived buffers
  // Forward arithmetic per row, multiply-adds counted as two: GEMMs and attention products
  // (what REMAT_PROFILE divides by time; elementwise work is left out). nullptr: none.
  double (*flops)(const Layer &l) = nullptr;
  double backward_flops = 0;  // backward's arithmetic per forward flop
};

// Whether a tensor rule applies to layer l (a bias only when the linear has one).
constexpr bool present(const TensorRule &r, const Layer &l, bool input_grad = true) {
  if (r.stem.empty()) return false;
  return r.when == When::always || (r.when == When::with_bias && l.bias) ||
         (r.when == When::with_input_grad && input_grad);
}

// Shared by the kinds' traits.
namespace kinds {
// Shape rule of the kinds that keep the stack's width.
constexpr Message keeps_width(Layer &l, const ShapeContext &c) {
  if (l.in != 0 && l.in != c.width)
    return cat<Message>("declared for width ", l.in, " but the stack carries ", c.width);
  l.in = l.out = c.width;
  return {};
}
// A per-row statistic [R] and a per-(row, head) one [R, H].
constexpr TensorRule row_statistic(std::string_view stem, std::string_view suffix = {}, When when = When::always) {
  return {stem, suffix, 1, {Dim::rows, Dim::none}, Init::zeros, false, when};
}
constexpr TensorRule head_statistic(std::string_view stem, std::string_view suffix) {
  return {stem, suffix, 2, {Dim::heads, Dim::rows}};
}
}  // namespace kinds

}  // namespace remat
