// A residual MLP for Fashion-MNIST: a stem projection, 16 pre-LayerNorm residual blocks
// (LayerNorm -> Linear -> GELU -> Linear, 2x hidden width) and a LayerNorm + Linear head.
export module mlp;
import remat.language;

export namespace mlp {
inline constexpr int image_pixels = 28 * 28, width = 256, hidden = 2 * width, blocks = 16, classes = 10;

inline constexpr remat::Model model = remat::checked([] {
  return remat::make_model(remat::input(image_pixels), remat::linear(image_pixels, width),
                           remat::repeat(blocks, remat::residual(remat::layer_norm(), remat::linear(width, hidden),
                                                                 remat::gelu(), remat::linear(hidden, width))),
                           remat::layer_norm(), remat::linear(width, classes), remat::softmax_cross_entropy(classes));
});

// The policy `make train` uses unless --checkpoint-policy says otherwise.
inline constexpr remat::Policy policy = remat::full;

inline constexpr int default_batch = 128;
// Its trainer (train-mlp): Debian's dataset-fashion-mnist.
inline constexpr remat::TrainerDefaults trainer{.data_dir = "/usr/share/datasets/fashion-mnist",
                                                .batch = default_batch,
                                                .epochs = 6,
                                                .learning_rate = 2e-3,
                                                .warmup_steps = 200};
}  // namespace mlp
