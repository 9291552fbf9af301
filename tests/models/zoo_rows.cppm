// Model zoo: feature rows (no sequences), blocks unlike the examples'. A loose stem whose
// dropout follows an activation; a repeat stage without a residual (ReLU, dropout after the
// activation and after a GEMM, so the block ends in dropout); a second repeat stage of another
// kind (pre-LayerNorm residual, GELU then dropout) whose selective kernels rebuild the LayerNorm
// and GELU outputs (recompute_modules); widths no multiple of 8 (10, 14, 22, 18).
export module zoo_rows;
import remat.language;

export namespace zoo_rows {
inline constexpr int features = 10, width = 14, hidden = 22, classes = 5;

inline constexpr remat::Model model = remat::checked([] {
  return remat::make_model(
      remat::input(features), remat::linear(features, width), remat::relu(), remat::dropout(),
      remat::repeat(3, remat::chain(remat::linear(width, hidden), remat::relu(), remat::dropout(),
                                    remat::linear(hidden, width), remat::dropout())),
      remat::repeat(2,
                    remat::residual(remat::layer_norm(), remat::linear(width, 18), remat::gelu(remat::gelu_exact),
                                    remat::dropout(), remat::linear(18, width)),
                    remat::recompute_modules(remat::norm, remat::activation)),
      remat::layer_norm(), remat::linear(width, classes), remat::softmax_cross_entropy(classes));
});
}  // namespace zoo_rows
