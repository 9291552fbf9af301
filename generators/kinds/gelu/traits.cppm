// The gelu kind (the tanh form, as GPT-2, or exact). Its output is a buffer where it is computed; selective
// policies (Megatron's) rebuild it in backward.
export module remat.language:gelu;
import :core;

export namespace remat {
namespace kinds {
inline constexpr Kind gelu{.name = "gelu",
                           .infer = keeps_width,
                           .reads_input = true,
                           .buffered = true,
                           .recomputed_by_selective = true,
                           .elementwise = true,
                           .module = Module::activation};
}  // namespace kinds

// GELU in its tanh form (GPT-2's activation_function "gelu_new"), or exact with erf (Transformers'
// "gelu"): remat::gelu(remat::gelu_exact).
struct GeluExact {};
inline constexpr GeluExact gelu_exact{};
constexpr Layer gelu() { return {Op::gelu}; }
constexpr Layer gelu(GeluExact) { return {.op = Op::gelu, .gelu_exact = true}; }
}  // namespace remat
