// The rms_norm kind (Llama's RMSNorm): x / sqrt(mean(x^2) + 1e-6) * gamma over the C features of
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

// RMSNorm (Llama): x / sqrt(mean(x^2) + 1e-6) * gamma, no bias.
constexpr Layer rms_norm(int width = 0) { return {Op::rms_norm, width, width}; }
}  // namespace remat
