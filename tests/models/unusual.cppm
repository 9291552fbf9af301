// A model unlike the examples, for the guarantees (planned == measured peak, no heap allocation
// in a step, bit-identical gradients under every policy): widths that are no multiple of the
// vector width (12, 36, 20), 3 heads of 4, a repeat stage right after the embedding and a second
// one right after it (two stacks; segments stay inside each), ReLU, a block that ends in dropout
// without a LayerNorm first, a loose attention whose q/k/v tensor is also a residual's skip (its
// gradient has two terms: the CPU kernels then take the row form), a head of 40 classes from 36
// features (an LM head, which runs fused: in two chunks at the tests' 96 samples).
export module unusual;
import remat.language;

export namespace unusual {
inline constexpr int vocab = 40, block_size = 6, width = 12, heads = 3, hidden = 20;

inline constexpr remat::Model model = remat::checked([] {
  return remat::make_model(
      remat::tokens(vocab, block_size), remat::embedding(vocab, width),
      remat::repeat(3, remat::residual(remat::layer_norm(), remat::linear(width, 3 * width),
                                       remat::causal_self_attention(heads), remat::linear(width, width))),
      remat::repeat(4, remat::residual(remat::linear(width, hidden), remat::relu(), remat::linear(hidden, width),
                                       remat::dropout())),
      // loose: an attention whose q/k/v tensor is also a residual's skip (two gradients into it)
      remat::linear(width, 3 * width),
      remat::residual(remat::causal_self_attention(heads), remat::linear(width, 3 * width)),
      remat::linear(3 * width, vocab), remat::softmax_cross_entropy(vocab));
});
// Its trainer (train-unusual, tests/CMakeLists.txt): none where the model names no policy; one step.
inline constexpr remat::Policy policy = remat::none;
inline constexpr remat::TrainerDefaults trainer{.batch = 8, .max_steps = 1, .eval_samples = 0};
}  // namespace unusual
