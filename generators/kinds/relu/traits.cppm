// The relu kind: max(x, 0), rebuilt elementwise where it is read.
export module remat.language:relu;
import :core;

export namespace remat {
namespace kinds {
inline constexpr Kind relu{
    .name = "relu", .infer = keeps_width, .reads_input = true, .elementwise = true, .module = Module::activation};
}  // namespace kinds

constexpr Layer relu() { return {Op::relu}; }
}  // namespace remat
