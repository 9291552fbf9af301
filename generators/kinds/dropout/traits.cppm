// The dropout kind: inverted dropout whose mask is a counter-based hash of (seed, step, block,
// element), so a recompute draws the same mask without saving it. It continues a GEMM's epilogue
// chain.
export module remat.language:dropout;
import :core;

export namespace remat {
namespace kinds {
inline constexpr Kind dropout{
    .name = "dropout", .infer = keeps_width, .chain_link = true, .draws_masks = true, .elementwise = true};
}  // namespace kinds

// Inverted dropout; the probability is a run-time value (--dropout).
constexpr Layer dropout() { return {Op::dropout}; }
}  // namespace remat
