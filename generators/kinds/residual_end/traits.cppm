// The residual_end marker: the residual sum, x + f(x), where residual(f...) closes its branch. It
// continues a GEMM's epilogue chain.
export module remat.language:residual_end;
import :core;

export namespace remat::kinds {
inline constexpr Kind residual_end{.name = "residual sum", .infer = keeps_width, .chain_link = true};
}  // namespace remat::kinds
