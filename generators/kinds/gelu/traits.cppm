// The gelu kind (tanh form, as GPT-2). Its output is a buffer where it is computed; selective
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

constexpr Layer gelu() { return {Op::gelu}; }
}  // namespace remat
