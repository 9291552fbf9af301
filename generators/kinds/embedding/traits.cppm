// The embedding kind: token ids in, a token table row (plus a position table row, unless the
// positions come from rope) out. Always a model's first layer: no input gradient.
export module remat.language:embedding;
import :core;

export namespace remat {
namespace kinds {
constexpr Message embedding_shape(Layer &l, const ShapeContext &c) {
  if (!c.first || c.block_size == 0) return "an embedding must be the first layer, after tokens(vocab, block_size)";
  if (l.vocab != c.vocab) return cat<Message>("embedding(", l.vocab, ", ...) but tokens(", c.vocab, ", ...)");
  if (l.out <= 0) return "needs a positive width";
  l.block_size = c.block_size;
  return {};
}
// token table [V, C], positions [T, C]
inline constexpr Kind embedding{
    .name = "embedding",
    .infer = embedding_shape,
    .repeatable = false,
    .params = {{{"p", "_w", 2, {Dim::out, Dim::vocab}, Init::uniform_fan_in},
                {"p", "_b", 2, {Dim::out, Dim::block_size}, Init::uniform_fan_in, false, When::with_bias}}}};
}  // namespace kinds

// Token + position embedding: token ids in, `width` features out.
constexpr Layer embedding(int vocab, int width) { return {Op::embedding, 1, width, 0, 0, vocab}; }
// Token embedding only (positions come from rope inside the blocks, as in Llama).
constexpr Layer token_embedding(int vocab, int width) {
  return {.op = Op::embedding, .in = 1, .out = width, .vocab = vocab, .bias = false};
}
}  // namespace remat
