// The rope kind: rotary position embedding on the q and k heads of a fused [q | k | v] row; v
// passes. Its backward (the inverse rotation) reads nothing; its output is buffered, and the
// attention after it reads that.
export module remat.language:rope;
import :core;

export namespace remat {
namespace kinds {
constexpr Message rope_shape(Layer &l, const ShapeContext &c) {
  if (c.block_size == 0) return "rope needs sequences: tokens(vocab, block_size)";
  if (l.heads < 1 || l.kv_heads < 1 || l.heads % l.kv_heads != 0)
    return cat<Message>("rope(", l.heads, ", ", l.kv_heads, ") needs heads >= 1 and kv_heads dividing them");
  const int parts = l.heads + 2 * l.kv_heads;
  if (c.width % parts != 0 || (c.width / parts) % 2 != 0)
    return cat<Message>("expects [q | k | v] of ", l.heads, " + 2 x ", l.kv_heads,
                        " heads of an even width but the stack carries ", c.width);
  l.in = l.out = c.width;
  l.block_size = c.block_size;
  return {};
}
inline constexpr Kind rope{.name = "rope", .infer = rope_shape, .buffered = true, .module = Module::rope};
}  // namespace kinds

// Rotary position embedding (the rotate-half form of Llama and GPT-NeoX, base theta: 10000 unless
// given, rope(9, 3, rope_theta(100000)) as a config's rope_theta; scaled as rope_type "llama3" with
// rope_llama3(...)) of the queries and keys in a fused [q | k | v] row of heads + 2 kv_heads heads:
// put it between the q/k/v projection and the attention.
inline constexpr double rope_default_theta = 10000;
constexpr Layer rope(int heads, int kv_heads = 0, RopeTheta theta = {rope_default_theta},
                     Layer::RopeScaling scaling = {}) {
  if (!(theta.value > 1)) throw "remat: rope(..., rope_theta(t)) needs t > 1";
  return {.op = Op::rope,
          .heads = heads,
          .kv_heads = kv_heads == 0 ? heads : kv_heads,
          .rope_theta = theta.value,
          .rope_scaling = scaling};
}
}  // namespace remat
