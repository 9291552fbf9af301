// A small token model of a user's own, unlike remat's examples: 160 tokens of vocabulary, 24 of
// context, 40 wide; each block is pre-RMSNorm attention (4 heads) and a pre-LayerNorm squared-ReLU
// MLP. It reads token files (train.bin, val.bin in --data-dir).
export module tinylm;
import remat.language;

export namespace tinylm {
inline constexpr int vocab = 160, context = 24, width = 40;

inline constexpr remat::Model model = remat::checked([] {
  return remat::make_model(
      remat::tokens(vocab, context), remat::embedding(vocab, width),
      remat::repeat(2, remat::chain(remat::residual(remat::rms_norm(), remat::linear(width, 3 * width, remat::no_bias),
                                                    remat::causal_self_attention(4), remat::linear(width, width)),
                                    remat::residual(remat::layer_norm(), remat::linear(width, 96), remat::relu2(),
                                                    remat::linear(96, width)))),
      remat::layer_norm(), remat::linear(width, vocab), remat::softmax_cross_entropy(vocab));
});

inline constexpr remat::Policy policy = remat::full;
inline constexpr remat::TrainerDefaults trainer{
    .batch = 8, .max_steps = 20, .learning_rate = 3e-3, .warmup_steps = 2, .eval_samples = 32};
}  // namespace tinylm
