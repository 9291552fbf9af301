// The linear kind: y = x w + b over the features of each row (w [K, O] row-major, b [O]), or
// y = x w without bias (Llama-style). A GEMM: its output is a buffer, it starts an epilogue chain.
export module remat.language:linear;
import :core;

export namespace remat {
namespace kinds {
constexpr Message linear_shape(Layer &l, const ShapeContext &c) {
  if (l.in <= 0 || l.out <= 0) return cat<Message>("linear(", l.in, ", ", l.out, ") needs positive widths");
  if (l.in != c.width) return cat<Message>("expects ", l.in, " input features but the stack carries ", c.width);
  return {};
}
constexpr double gemm_flops(const Layer &l) { return 2.0 * l.in * l.out; }

inline constexpr Kind linear{.name = "linear",
                             .infer = linear_shape,
                             .reads_input = true,
                             .buffered = true,
                             .gemm = true,
                             // w [K, O] row-major (y = x w + b), b [O]
                             .module = Module::projection,
                             .params = {{{"p", "_w", 2, {Dim::out, Dim::in}, Init::uniform_fan_in, true},
                                         {"p", "_b", 1, {Dim::out, Dim::none}, Init::zeros, false, When::with_bias}}},
                             .flops = gemm_flops,
                             .backward_flops = 2};  // dx and dW
}  // namespace kinds

constexpr Layer linear(int in, int out) { return {Op::linear, in, out}; }
// A linear without bias (y = x w), as in Llama-style models.
struct NoBias {};
inline constexpr NoBias no_bias{};
constexpr Layer linear(int in, int out, NoBias) { return {.op = Op::linear, .in = in, .out = out, .bias = false}; }
// A linear whose weight is another layer's parameter (tie_word_embeddings): the token table [V, C]
// of the embedding named `target` (remat::name), read transposed, so linear(C, V, no_bias,
// tied_to("wte")) is the LM head of GPT-2 or Llama with tied embeddings. One tensor: one AdamW
// state, its gradient the sum of both uses (the head's first, then the embedding's, in every
// policy). check() refuses a tie whose shapes do not fit, naming both layers.
struct TiedTo {
  Tag target;
};
constexpr TiedTo tied_to(Tag target) { return {target}; }
constexpr Layer linear(int in, int out, NoBias, TiedTo tie) {
  return {.op = Op::linear, .in = in, .out = out, .bias = false, .tie = tie.target};
}
}  // namespace remat
