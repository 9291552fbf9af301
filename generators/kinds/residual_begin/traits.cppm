// The residual_begin marker: residual(f...) (dsl/language.cppm) opens a branch with it. It
// produces nothing; the layers after it read its source, and the matching residual_end adds that
// source back.
export module remat.language:residual_begin;
import :core;

export namespace remat::kinds {
inline constexpr Kind residual_begin{.name = "residual(", .infer = keeps_width};
}  // namespace remat::kinds
