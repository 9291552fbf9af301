// The swiglu kind, the gate of a gated MLP: [a | b] (2H features) in, silu(a) * b (H) out.
export module remat.language:swiglu;
import :core;

export namespace remat {
namespace kinds {
constexpr Message halves_width(Layer &l, const ShapeContext &c) {
  if (c.width % 2 != 0) return cat<Message>("expects [gate | up] (2H features) but the stack carries ", c.width);
  l.in = c.width;
  l.out = c.width / 2;
  return {};
}
inline constexpr Kind swiglu{.name = "swiglu",
                             .infer = halves_width,
                             .reads_input = true,
                             .buffered = true,
                             .recomputed_by_selective = true,
                             .module = Module::activation};
}  // namespace kinds

// The gate of a gated MLP: [a | b] (2H features) in, silu(a) * b (H) out, as in
// linear(C, 2H) -> swiglu -> linear(H, C).
constexpr Layer swiglu() { return {Op::swiglu}; }
}  // namespace remat
