// The layer_norm kind: (x - mean) * rstd * gamma + beta (rstd = 1 / sqrt(var + eps)) over the C features of each row.
// Its row statistics (mean, rstd) are kept for its backward like internals; the row sums of its input gradient are
// short-lived workspace.
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

// LayerNorm; eps 1e-5 unless given (layer_norm(epsilon(1e-6)), as a config's layer_norm_epsilon).
inline constexpr double layer_norm_default_eps = 1e-5;
constexpr Layer layer_norm(int width = 0) {
  return {.op = Op::layer_norm, .in = width, .out = width, .eps = layer_norm_default_eps};
}
constexpr Layer layer_norm(Epsilon eps) {
  if (!(eps.value > 0)) throw "remat: layer_norm(epsilon(e)) needs e > 0";
  return {.op = Op::layer_norm, .eps = eps.value};
}
}  // namespace remat
