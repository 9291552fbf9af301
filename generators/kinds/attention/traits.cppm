// The attention kind: causal self-attention on fused [q | k | v] features, multi-head or
// grouped-query, dropout on its probabilities. The forward writes a log-sum-exp per (row, head),
// which backward reads to rebuild the probabilities; backward also reads the attention's output.
export module remat.language:attention;
import :core;

export namespace remat {
namespace kinds {
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
      return cat<Message>("expects fused q, k, v of ", l.heads, " + 2 x ", l.kv_heads, " heads but the stack carries ",
                          c.width);
  }
  l.in = c.width;
  l.out = c.width / (l.heads + 2 * l.kv_heads) * l.heads;
  l.block_size = c.block_size;
  return {};
}
// causal: q k^T and p v over (T + 1) / 2 keys on average
constexpr double attention_flops(const Layer &l) { return 2.0 * (l.block_size + 1) * l.out; }

inline constexpr Kind attention{
    .name = "causal_self_attention",
    .infer = attention_shape,
    .reads_input = true,
    .reads_output = true,
    .buffered = true,
    .recomputed_by_selective = true,
    .reads_input_buffer = true,
    .draws_masks = true,
    .module = Module::core_attn,
    .stats = {{head_statistic("att", "_lse")}},
    // delta = dout . out a (row, head); the CPU's gradient a query head at a
    // time before the heads of a group are added (runtime/attention.h)
    .workspace = {{head_statistic("att", "_delta"), {"att", "_dqkv_heads", 2, {Dim::per_head_qkv, Dim::rows}}}},
    // backward rebuilds p and forms dp, dv, dq and dk: 5 products of the forward's 2
    .flops = attention_flops,
    .backward_flops = 2.5};
}  // namespace kinds

// Causal multi-head self-attention core on fused [q | k | v] features (3C in, C out). With
// kv_heads < heads, grouped-query attention: [q | k | v] of (heads + 2 kv_heads) D features in,
// heads D out, query head h reading key / value head h / (heads / kv_heads).
constexpr Layer causal_self_attention(int heads, int kv_heads = 0) {
  return {.op = Op::attention, .heads = heads, .kv_heads = kv_heads == 0 ? heads : kv_heads};
}
}  // namespace remat
