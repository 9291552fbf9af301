// The rms_norm kind (Llama's RMSNorm): x / sqrt(mean(x^2) + eps) * gamma over the C features of
// each row, no bias. Its row statistic rstd is kept for its backward like an internal.
export module remat.language:rms_norm;
import :core;

export namespace remat {
namespace kinds {
inline constexpr Kind rms_norm{.name = "rms_norm",
                               .infer = keeps_width,
                               .reads_input = true,
                               .module = Module::norm,
                               .params = {{{"p", "_w", 1, {Dim::out, Dim::none}, Init::ones}}},
                               .stats = {{row_statistic("rstd")}},
                               .workspace = {{row_statistic("s", "_1", When::with_input_grad)}}};
}  // namespace kinds

// RMSNorm (Llama): x / sqrt(mean(x^2) + eps) * gamma, no bias; eps 1e-6 unless given
// (rms_norm(epsilon(1e-5)), as Llama's rms_norm_eps).
inline constexpr double rms_norm_default_eps = 1e-6;
constexpr Layer rms_norm(int width = 0) {
  return {.op = Op::rms_norm, .in = width, .out = width, .eps = rms_norm_default_eps};
}
constexpr Layer rms_norm(Epsilon eps) {
  if (!(eps.value > 0)) throw "remat: rms_norm(epsilon(e)) needs e > 0";
  return {.op = Op::rms_norm, .eps = eps.value};
}
}  // namespace remat
