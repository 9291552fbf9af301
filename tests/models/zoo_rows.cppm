// Model zoo: feature rows (no sequences: Fashion-MNIST's 784 pixels and 10 classes, so that its
// trainer, train-zoo-rows, runs on the MLP's data), blocks unlike the examples'. A loose stem whose
// dropout follows an activation; a repeat stage without a residual (ReLU, dropout after the
// activation and after a GEMM, so the block ends in dropout); a second repeat stage of another
// kind (pre-LayerNorm residual, GELU then dropout) whose selective kernels rebuild the LayerNorm
// and GELU outputs (recompute_modules); widths no multiple of 8 (14, 22, 18).
export module zoo_rows;
import remat.language;

export namespace zoo_rows {
inline constexpr int features = 784, width = 14, hidden = 22, classes = 10;

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
// Its trainer (train-zoo-rows, tests/CMakeLists.txt): none where the model names no policy; one step.
inline constexpr remat::Policy policy = remat::none;
inline constexpr remat::TrainerDefaults trainer{
    .data_dir = "/usr/share/datasets/fashion-mnist", .batch = 8, .max_steps = 1, .eval_samples = 0};
}  // namespace zoo_rows
