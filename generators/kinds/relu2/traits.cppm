// The relu2 kind: squared ReLU, max(x, 0)^2 (Primer; the MLP activation of Nemotron-4 and
// modded-nanoGPT). Its backward reads its input; its output is a buffer where it is computed, and
// selective policies (Megatron's) rebuild it in backward, as GELU's.
export module remat.language:relu2;
import :core;

export namespace remat {
namespace kinds {
inline constexpr Kind relu2{.name = "relu2",
                            .infer = keeps_width,
                            .reads_input = true,
                            .buffered = true,
                            .recomputed_by_selective = true,
                            .elementwise = true,
                            .module = Module::activation};
}  // namespace kinds

// Squared ReLU: max(x, 0)^2.
constexpr Layer relu2() { return {Op::relu2}; }
}  // namespace remat
