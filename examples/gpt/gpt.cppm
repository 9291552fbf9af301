// A character-level GPT: token + position embedding, 6 pre-LayerNorm transformer blocks (causal
// self-attention with a fused q/k/v projection, GELU MLP of 4x width, dropout on both residual
// branches and on the attention probabilities), a final LayerNorm and the LM head.
//
// Sizes are compile-time constants: the generated kernels are specialized to them. To train
// another size, change them here (or declare another model module with remat_add_model).
export module gpt;
import remat.language;

export namespace gpt {
inline constexpr int vocab = 128;      // bytes; non-ASCII bytes are read as '?'
inline constexpr int block_size = 64;  // T: characters of context
inline constexpr int n_layer = 6, n_head = 4, n_embd = 128;

inline constexpr remat::Block transformer_block =
    remat::chain(remat::residual(remat::layer_norm(), remat::linear(n_embd, 3 * n_embd),
                                 remat::causal_self_attention(n_head), remat::linear(n_embd, n_embd), remat::dropout()),
                 remat::residual(remat::layer_norm(), remat::linear(n_embd, 4 * n_embd), remat::gelu(),
                                 remat::linear(4 * n_embd, n_embd), remat::dropout()));

inline constexpr remat::Model model = remat::checked([] {
  return remat::make_model(remat::tokens(vocab, block_size), remat::embedding(vocab, n_embd), remat::dropout(),
                           remat::repeat(n_layer, transformer_block), remat::layer_norm(), remat::linear(n_embd, vocab),
                           remat::softmax_cross_entropy(vocab));
});

// The policy `make train` uses unless --checkpoint-policy says otherwise.
inline constexpr remat::Policy policy = remat::selective;
inline constexpr int default_batch = 32;  // sequences of block_size characters
// Its trainer (train-gpt): the fortune cookie files of Debian's `fortunes`, 90% train, 10% validation.
inline constexpr remat::TrainerDefaults trainer{.data_dir = "/usr/share/games/fortunes",
                                                .batch = default_batch,
                                                .max_steps = 1500,
                                                .learning_rate = 2e-3,
                                                .warmup_steps = 100,
                                                .eval_samples = 256,
                                                .eval_steps = 250,
                                                .sample_length = 400};

}  // namespace gpt
