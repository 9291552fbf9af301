// The layer_norm kind: (x - mean) * rstd * gamma + beta over the C features of each row. Its row
// statistics (mean, rstd) are kept for its backward like internals; the row sums of its input
// gradient are short-lived workspace.
export module remat.language:layer_norm;
import :core;

export namespace remat {
namespace kinds {
inline constexpr Kind layer_norm{
    .name = "layer_norm",
    .infer = keeps_width,
    .reads_input = true,
    .module = Module::norm,
    .params = {{{"p", "_w", 1, {Dim::out, Dim::none}, Init::ones}, {"p", "_b", 1, {Dim::out, Dim::none}, Init::zeros}}},
    .stats = {{row_statistic("mean"), row_statistic("rstd")}},
    .workspace = {{row_statistic("s", "_1", When::with_input_grad), row_statistic("s", "_2", When::with_input_grad)}}};
}  // namespace kinds

constexpr Layer layer_norm(int width = 0) { return {Op::layer_norm, width, width}; }
}  // namespace remat
